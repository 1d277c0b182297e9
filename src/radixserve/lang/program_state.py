"""Program state and its executor: ``s += expr`` queues work, reading a variable waits for it.

Every state (the root and each fork) owns a :class:`_StreamExecutor`, a worker thread
that interprets the state's expressions in order. ``s += gen(...)`` returns at once, so a
program that writes ``for f in forks: f += gen(...)`` gets all branches in flight
together and the runtime batches them; reading ``s["x"]`` (or ``s.text()``) blocks until
the state's queue has drained. This is SGLang's execution model, and the reason forks
cost about one branch of wall time instead of n.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from radixserve.lang.ir import (DEFAULT_GEN_PARAMS, Expr, Gen, GenParams, RoleBegin, RoleEnd, Select, Text, flatten,
                                to_expr)

if TYPE_CHECKING:
    from radixserve.lang.backend import Backend

JOIN_MODES = ("gather_variable", "concate_and_append")


class _StreamExecutor:
    """A FIFO of callables run by one worker thread, started on demand and ended when idle. The
    first exception stops the queue; it is re-raised by :meth:`sync` (and so by every later read of
    the state), which is where a program learns that a request failed."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._running = False
        self.error: BaseException | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cond:
            if self.error is not None:
                raise self.error
            self._queue.append(fn)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name=self._name, daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self.error is not None:
                    self._queue.clear()
                    self._running = False
                    self._cond.notify_all()
                    return
                fn = self._queue.popleft()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the program thread
                with self._cond:
                    self.error = e

    def sync(self) -> None:
        with self._cond:
            while self._running:
                self._cond.wait()
            if self.error is not None:
                raise self.error


class ProgramState:
    """The text, variables and chat history of one program (or one fork of it)."""

    def __init__(self, backend: "Backend", defaults: GenParams | None = None, hint: bool = True,
                 stream: bool = False, *, _parent: "ProgramState | None" = None):
        self.backend = backend
        self.defaults = (defaults or GenParams()).merged_over(DEFAULT_GEN_PARAMS)
        self.hint = hint
        self.stream = stream
        self._lock = threading.Condition()
        self._text = "" if _parent is None else _parent._text
        self._vars: dict[str, Any] = {} if _parent is None else dict(_parent._vars)
        self._meta: dict[str, Any] = {} if _parent is None else dict(_parent._meta)
        self._messages: list[dict[str, str]] = [] if _parent is None else [dict(m) for m in _parent._messages]
        self._role: tuple[str, int] | None = None if _parent is None else _parent._role
        self._chunks: list[str] = []
        self._done = False
        self._executor = _StreamExecutor("radixserve-lang-state")
        # Set by the interpreter when the program body raised (stream mode reports it).
        self.program_error: BaseException | None = None

    # ---------------------------------------------------------------- writing
    def __iadd__(self, other: object) -> "ProgramState":
        for e in flatten(to_expr(other)):
            self._executor.submit(lambda e=e: self._execute(e))
        return self

    def _append(self, text: str) -> None:
        if not text:
            return
        with self._lock:
            self._text += text
            self._chunks.append(text)
            self._lock.notify_all()

    def _execute(self, e: Expr) -> None:
        if isinstance(e, Text):
            self._append(e.text)
        elif isinstance(e, Gen):
            self._gen(e)
        elif isinstance(e, Select):
            self._select(e)
        elif isinstance(e, RoleBegin):
            if self._role is not None:
                raise ValueError(f"a {e.role!r} block cannot start inside the open {self._role[0]!r} block")
            begin, _ = self.backend.chat_format.role_delimiters(self._messages, e.role)
            self._append(begin)
            self._role = (e.role, len(self._text))
        elif isinstance(e, RoleEnd):
            if self._role is None or self._role[0] != e.role:
                raise ValueError(f"{e.role}_end() without a matching {e.role}_begin()")
            role, start = self._role
            content = self._text[start:]
            _, end = self.backend.chat_format.role_delimiters(self._messages, role)
            self._append(end)
            self._messages.append({"role": role, "content": content})
            self._role = None
        else:  # pragma: no cover - to_expr only builds the kinds above
            raise TypeError(f"unknown expression {e!r}")

    def _gen(self, e: Gen) -> None:
        params = e.params.merged_over(self.defaults)
        prompt = self._text
        if not prompt:
            raise ValueError(f"gen({e.name!r}) needs some text before it (the prompt is empty)")
        if self.stream:
            res = self.backend.generate(prompt, params, on_delta=self._append)
        else:
            res = self.backend.generate(prompt, params)
            self._append(res.text)
        self._store(e.name, res.text, res)

    def _store(self, name: str | None, value: Any, meta: Any) -> None:
        """Capture a ``gen``/``select`` result in variable ``name`` (None: not captured)."""
        if name is not None:
            with self._lock:
                self._vars[name] = value
                self._meta[name] = meta

    def _select(self, e: Select) -> None:
        res = self.backend.select(self._text, e.choices, e.choices_method, self.hint)
        self._append(res.choice)
        self._store(e.name, res.choice, res)

    # ---------------------------------------------------------------- reading
    def sync(self) -> None:
        """Wait until everything appended so far has run; re-raise the first error."""
        self._executor.sync()

    def __getitem__(self, name: str) -> Any:
        self.sync()
        with self._lock:
            if name not in self._vars:
                known = ", ".join(sorted(self._vars)) or "none"
                raise KeyError(f"unknown variable {name!r} (captured so far: {known})")
            return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._vars

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        """Store a Python value as a variable (e.g. a vote result computed by the program)."""
        self.sync()
        with self._lock:
            self._vars[name] = value

    def get_meta_info(self, name: str) -> Any:
        """The backend's record for a variable: a GenResult (tokens, cached_tokens, finish
        reason) for ``gen``, a SelectResult (every choice's scores) for ``select``."""
        self.sync()
        if name not in self._meta:
            raise KeyError(f"no meta info for variable {name!r}")
        return self._meta[name]

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._vars)

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks so far as chat messages (what a chat API would receive)."""
        self.sync()
        return [dict(m) for m in self._messages]

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-60:]!r}, vars={sorted(self._vars)})"

    # ---------------------------------------------------------------- forks
    def fork(self, n: int = 1) -> "ProgramStateGroup":
        """``n`` independent copies of this state that share everything written so far. With the
        frontend hint on, the shared text is first sent as a prefill-only request, so it is in the
        radix tree before any branch's request arrives; every branch then computes only its own
        tail."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork(n) needs an int n >= 1, got {n!r}")
        self.sync()
        if self._role is not None:
            raise ValueError(f"cannot fork inside an open {self._role[0]!r} block")
        if self.hint and self._text:
            self.backend.prefill(self._text)
        branches = [ProgramState(self.backend, self.defaults, self.hint, self.stream, _parent=self)
                    for _ in range(n)]
        return ProgramStateGroup(branches, self, len(self._text))

    # ---------------------------------------------------------------- streaming
    def _finish(self) -> None:
        with self._lock:
            self._done = True
            self._lock.notify_all()

    def text_iter(self) -> Iterator[str]:
        """Text chunks in order as they are appended (prompt pieces and generated deltas);
        ends when the program has finished. Re-raises the program's error at the end."""
        i = 0
        while True:
            with self._lock:
                while i >= len(self._chunks) and not self._done:
                    self._lock.wait()
                chunks = self._chunks[i:]
                i = len(self._chunks)
                done = self._done
            yield from chunks
            if done and i >= len(self._chunks):
                break
        err = self.program_error or self._executor.error
        if err is not None:
            raise err

    def wait(self) -> "ProgramState":
        """Block until a streamed run has finished (no-op for a normal run)."""
        with self._lock:
            while not self._done:
                self._lock.wait()
        if self.program_error is not None:
            raise self.program_error
        self.sync()
        return self


class ProgramStateGroup:
    """The result of ``s.fork(n)``: indexable, iterable, and joinable back into the parent."""

    def __init__(self, states: list[ProgramState], parent: ProgramState, fork_len: int):
        self.states = states
        self.parent = parent
        self.fork_len = fork_len  # length of the shared text at the fork

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: object) -> "ProgramStateGroup":
        """``forks += expr`` appends the same expression to every branch."""
        for s in self.states:
            s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and bring results back into the parent. ``gather_variable``
        (default): each variable created in the branches becomes a list in the parent
        (``s["answer"] == [branch0, branch1, ...]``). ``concate_and_append``: the branches' new text
        is appended to the parent in order."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}, got {mode!r}")
        for s in self.states:
            s.sync()
        parent = self.parent
        parent.sync()
        if mode == "gather_variable":
            names = list(dict.fromkeys(k for s in self.states for k in s._vars if k not in parent._vars))
            with parent._lock:
                for k in names:
                    parent._vars[k] = [s._vars.get(k) for s in self.states]
        else:
            parent += "".join(s._text[self.fork_len :] for s in self.states)
            parent.sync()
