"""Data-parallel router: requests go to the worker whose cache already holds their prefix.

Per worker, an exact mirror of its radix tree is rebuilt from the worker's own cache events
(:mod:`radixserve.kv_events` on the worker side, :mod:`.events` and :mod:`.mirror` here);
:mod:`.policies` turns mirrors and loads into a choice; :mod:`.app` is the HTTP front
(both APIs, streaming, retries); :mod:`.core` holds the state and the health checks.

``radixserve router --worker URL --worker-events tcp://... ...`` (see :mod:`.cli`).
"""

from radixserve.router.config import POLICIES, RouterConfig
from radixserve.router.core import NoWorkerAvailable, Router

__all__ = ["POLICIES", "RouterConfig", "Router", "NoWorkerAvailable", "RouterApp"]


def __getattr__(name: str):
    if name == "RouterApp":  # the HTTP front, imported only when asked for
        from radixserve.router.app import RouterApp

        return RouterApp
    raise AttributeError(name)
