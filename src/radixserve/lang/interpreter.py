"""``@function`` programs: ``run``, ``run_batch``, the default backend and the hint switch.

The frontend-hint switch (for the ablation) resolves in this order, most specific first:
``prog.run(..., hint=False)`` > ``@function(hint=False)`` > ``lang.config.frontend_hint``
(global, default True). With it off, forks and selects send no prefill-only request for
the shared prefix; the runtime then discovers the sharing on its own (or not).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from radixserve.lang.backend import Backend, EngineBackend
from radixserve.lang.ir import GenParams
from radixserve.lang.program_state import ProgramState


@dataclass
class LangConfig:
    """Process-wide defaults of the frontend (``radixserve.lang.config``)."""

    frontend_hint: bool = True


config = LangConfig()

_default_backend: Backend | None = None
_backend_lock = threading.Lock()


def set_default_backend(backend: Any) -> Backend:
    """Use ``backend`` for every program run without ``backend=``: a :class:`Backend`
    (``RuntimeEndpoint(url)``, ``EngineBackend(...)``) or a bare :class:`~radixserve.Engine`,
    which is wrapped in an :class:`EngineBackend`."""
    global _default_backend
    b = as_backend(backend)
    with _backend_lock:
        _default_backend = b
    return b


def get_default_backend() -> Backend | None:
    return _default_backend


def as_backend(backend: Any) -> Backend:
    if isinstance(backend, Backend):
        return backend
    from radixserve.engine.engine import Engine

    if isinstance(backend, Engine):
        return EngineBackend(backend)
    raise TypeError(f"expected a Backend or an Engine, got {type(backend).__name__}")


class SglFunction:
    """A program: a Python function whose first parameter is the state ``s``."""

    def __init__(self, func: Callable[..., Any], hint: bool | None = None):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {func.__name__} must take the state as its first parameter")
        self.func = func
        self.hint = hint
        self.arg_names = params[1:]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def _resolve(self, backend: Any, hint: bool | None) -> tuple[Backend, bool]:
        b = as_backend(backend) if backend is not None else _default_backend
        if b is None:
            raise RuntimeError("no backend: call radixserve.lang.set_default_backend(...) or pass backend=...")
        h = hint if hint is not None else self.hint if self.hint is not None else config.frontend_hint
        return b, bool(h)

    def run(self, *args: Any, max_new_tokens: int | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            stop: str | Sequence[str] | None = None, stream: bool = False, backend: Any = None,
            hint: bool | None = None, **kwargs: Any) -> ProgramState:
        """Run the program once; returns its state (``state["name"]``, ``state.text()``). Sampling
        options here are the run's defaults for every ``gen`` that does not set its own. With
        ``stream=True`` the program body runs in a background thread and the state is returned at
        once: iterate ``state.text_iter()`` for text as it arrives."""
        b, h = self._resolve(backend, hint)
        defaults = GenParams(
            max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            stop=[stop] if isinstance(stop, str) else list(stop) if stop is not None else None,
        )
        s = ProgramState(b, defaults, hint=h, stream=stream)
        if stream:
            threading.Thread(target=self._body, args=(s, args, kwargs), daemon=True,
                             name=f"radixserve-lang-{self.__name__}").start()
            return s
        self._body(s, args, kwargs)
        if s.program_error is not None:
            raise s.program_error
        return s

    def _body(self, s: ProgramState, args: tuple, kwargs: dict) -> None:
        try:
            self.func(s, *args, **kwargs)
            s.sync()
        except BaseException as e:  # noqa: BLE001 - raised by run() or text_iter()
            s.program_error = e
        finally:
            s._finish()

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], num_threads: int | str = "auto",
                  backend: Any = None, hint: bool | None = None, **run_kwargs: Any) -> list[ProgramState]:
        """Run the program once per argument dict, ``num_threads`` at a time, results in input
        order. Concurrent programs' requests meet in the runtime and are batched there."""
        items = list(batch_kwargs)
        for i, kw in enumerate(items):
            if not isinstance(kw, dict):
                raise TypeError(f"run_batch: item {i} must be a dict of arguments, got {type(kw).__name__}")
        if not items:
            return []
        if num_threads == "auto":
            n = max(1, min(len(items), 64, 4 * (os.cpu_count() or 1)))
        elif isinstance(num_threads, int) and not isinstance(num_threads, bool) and num_threads >= 1:
            n = num_threads
        else:
            raise ValueError(f"num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
        b, h = self._resolve(backend, hint)
        if n == 1:
            return [self.run(backend=b, hint=h, **run_kwargs, **kw) for kw in items]
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="radixserve-lang-batch") as pool:
            futs = [pool.submit(self.run, backend=b, hint=h, **run_kwargs, **kw) for kw in items]
            return [f.result() for f in futs]

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Calling a program runs it (SGLang also allows this)."""
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, *, hint: bool | None = None) -> Any:
    """Decorator that turns ``def prog(s, ...)`` into a runnable program: bare (``@function``) or
    with options (``@function(hint=False)``)."""
    if func is None:
        return lambda f: SglFunction(f, hint=hint)
    return SglFunction(func, hint=hint)
