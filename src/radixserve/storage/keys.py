"""Names of KV pages in shared storage: a SHA-256 chain over tokens, salt and model.

A page is ``page_tokens`` consecutive tokens, aligned from the start of the sequence. Its key
is ``SHA-256(domain, model fingerprint, salt, parent page's key, the page's tokens)``, so:

* the key names the whole prefix, not just the page's tokens (the parent's key is inside),
  which is what lets a reader walk a request's pages in order and stop at the first miss;
* two servers running the same model compute the same keys and share pages, while a different
  model, dtype, layer shape, page size or tenant (``salt``) gives unrelated keys: objects can
  never be confused across them, even in one Redis database;
* the hash is cryptographic and stable across processes. Python's ``hash()`` is neither: it is
  salted per process (no sharing across restarts) and trivially collidable for ints (a
  colliding prompt could read another tenant's KV; cf. vLLM CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from array import array
from dataclasses import asdict, dataclass
from typing import Hashable, List

import torch

from radixserve.memory.quant import row_elems, storage_dtype

__all__ = ["ModelFingerprint", "encode_salt", "page_keys", "KEY_BYTES"]

KEY_BYTES = 32
_DOMAIN = b"radixserve/kv-page/v1\x00"


@dataclass(frozen=True)
class ModelFingerprint:
    """What must be equal for two servers to exchange KV pages. ``model`` should name the
    exact weights (a hub id with revision, or a path plus a content hash in ``weights``): two
    checkpoints under one name would otherwise share pages."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    weights: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"dtype must be a non-empty string, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.weights, str):
            raise ValueError(f"weights must be a string, got {self.weights!r}")
        # The digest is computed once: every page key and every object header uses it.
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        object.__setattr__(self, "_digest", hashlib.sha256(b"radixserve/model\x00" + canon).digest())

    @property
    def digest(self) -> bytes:
        """32 bytes identifying the fingerprint (in every key and every object header)."""
        return self._digest  # type: ignore[attr-defined]

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element dtype of the payload: the KV dtype, or bytes for a quantized kind."""
        return storage_dtype(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.storage_dtype).element_size()

    @property
    def row_dim(self) -> int:
        """Elements per head row: ``head_dim``, plus the scale's bytes for a quantized kind."""
        return row_elems(self.dtype, self.head_dim)

    @property
    def page_shape(self) -> tuple:
        """Shape of one page's payload: all layers' K and V of ``page_tokens`` tokens (rows in
        the pool's format: a quantized row carries its scale)."""
        return (self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.row_dim)

    @property
    def page_nbytes(self) -> int:
        return math.prod(self.page_shape) * self.element_size

    @classmethod
    def for_pool(cls, model: str, pool, page_tokens: int, weights: str = "") -> "ModelFingerprint":
        """The fingerprint of KV laid out like ``pool`` (a KVPool or HostKVPool): its KV dtype
        by name (int8 and fp8 pools both hold bytes, and must never share pages)."""
        return cls(model, pool.kv_dtype, pool.num_layers, pool.num_kv_heads, pool.head_dim, page_tokens, weights)


def encode_salt(salt: Hashable) -> bytes:
    """A byte string that identifies ``salt`` unambiguously (type-tagged, length-prefixed):
    None, str, bytes, int and tuples of these exactly; anything else by its ``repr`` (stable
    for value types; an object whose repr holds an address gets no sharing)."""
    if salt is None:
        return b"N"
    if isinstance(salt, bool):
        return b"B1" if salt else b"B0"
    if isinstance(salt, str):
        raw = salt.encode("utf-8", "surrogatepass")
        return b"S" + struct.pack("<Q", len(raw)) + raw
    if isinstance(salt, (bytes, bytearray)):
        return b"Y" + struct.pack("<Q", len(salt)) + bytes(salt)
    if isinstance(salt, int):
        raw = str(salt).encode()
        return b"I" + struct.pack("<Q", len(raw)) + raw
    if isinstance(salt, tuple):
        parts = [encode_salt(x) for x in salt]
        return b"T" + struct.pack("<Q", len(parts)) + b"".join(parts)
    raw = repr(salt).encode("utf-8", "surrogatepass")
    return b"R" + struct.pack("<Q", len(raw)) + raw


def page_keys(tokens: bytes, salt: Hashable, fingerprint: ModelFingerprint,
              num_pages: int | None = None) -> List[bytes]:
    """Keys of the first ``num_pages`` whole pages of ``tokens`` (packed uint32, the tree's key
    format); all whole pages when ``num_pages`` is None. ``keys[j]`` names ``tokens[:(j+1)*P]``."""
    if sys.byteorder != "little":  # keys are defined over little-endian uint32 ids
        swapped = array("I", tokens)
        swapped.byteswap()
        tokens = swapped.tobytes()
    p4 = 4 * fingerprint.page_tokens
    avail = len(tokens) // p4
    n = avail if num_pages is None else min(num_pages, avail)
    salt_b = encode_salt(salt)
    base = hashlib.sha256(_DOMAIN + fingerprint.digest + struct.pack("<Q", len(salt_b)) + salt_b)
    keys: List[bytes] = []
    parent = bytes(KEY_BYTES)
    for j in range(n):
        h = base.copy()
        h.update(parent + tokens[j * p4 : (j + 1) * p4])
        parent = h.digest()
        keys.append(parent)
    return keys
