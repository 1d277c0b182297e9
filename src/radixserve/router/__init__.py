"""Data-parallel router: requests go to the worker whose cache already holds their prefix.

The placement itself (per-worker tree mirrors fed by the workers' cache events, health,
policies) is :mod:`radixserve.placement`, shared with the data-parallel server; here are
:mod:`.app`, the HTTP front (both APIs, streaming, retries), and :mod:`.fleet`, the state and
the health checks.

``radixserve router --worker URL --worker-events tcp://... ...`` (see :mod:`.cli`).
"""

from radixserve.placement.config import POLICIES, RouterConfig
from radixserve.router.fleet import Router
from radixserve.placement.worker import NoWorkerAvailable

__all__ = ["POLICIES", "RouterConfig", "Router", "NoWorkerAvailable", "RouterApp"]


def __getattr__(name: str):
    if name == "RouterApp":  # the HTTP front, imported only when asked for
        from radixserve.router.app import RouterApp

        return RouterApp
    raise AttributeError(name)
