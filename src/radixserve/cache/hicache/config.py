"""Configuration of the tiered cache (HiCache): off unless ``l2_tokens > 0``.

:class:`HiCacheConfig` is a view of :class:`~radixserve.config.EngineConfig`, which declares
every option: its fields are the engine's ``hicache_*`` fields without the prefix, with their
defaults, help (``FIELD_HELP``) and validation (``check_hicache``), plus ``model_name``, which
the engine takes from its model. ``HiCacheConfig.from_engine(cfg)`` builds it from an engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from radixserve.config import HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES, EngineConfig, check_hicache

__all__ = ["HiCacheConfig", "WRITE_POLICIES", "PREFETCH_POLICIES"]

#: SGLang's names. write_through: copy a run to L2 when it enters the tree;
#: write_through_selective: once it has been reused ``write_through_threshold`` times;
#: write_back: only when it is evicted from L1.
WRITE_POLICIES = HICACHE_WRITE_POLICIES
#: best_effort: admit the request whenever the scheduler gets to it, with whatever pages have
#: arrived; wait_complete: admit only once the prefetch has finished; timeout: wait for it at
#: most ``prefetch_timeout_s``, then admit with what has arrived.
PREFETCH_POLICIES = HICACHE_PREFETCH_POLICIES

_PREFIX = "hicache_"


class _HiCacheView:
    storage: Optional[str]  # None for no storage tier (the engine's "")
    model_name: str  # in the storage fingerprint: pages are shared only between equal ones

    def __post_init__(self) -> None:
        if self.storage == "":
            object.__setattr__(self, "storage", None)
        check_hicache(self, "")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")

    @property
    def enabled(self) -> bool:
        """Whether the tiers are on (else the engine builds a plain RadixCache)."""
        return self.l2_tokens > 0

    @classmethod
    def from_engine(cls, cfg: EngineConfig, model_name: Optional[str] = None) -> Any:
        """The HiCache options of ``cfg``. ``model_name`` defaults to the model and dtype, so
        servers share storage pages only for the same weights."""
        kw = {f.name: getattr(cfg, _PREFIX + f.name) for f in dataclasses.fields(cls) if f.name != "model_name"}
        return cls(**kw, model_name=model_name or f"{cfg.model}:{cfg.dtype}")


HiCacheConfig = dataclasses.make_dataclass(
    "HiCacheConfig",
    [(f.name[len(_PREFIX):], f.type, dataclasses.field(default=f.default))
     for f in dataclasses.fields(EngineConfig) if f.name.startswith(_PREFIX)]
    + [("model_name", "str", dataclasses.field(default="model"))],
    bases=(_HiCacheView,), frozen=True,
)
HiCacheConfig.__module__ = __name__
