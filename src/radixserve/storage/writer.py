"""Background writes of new pages to L3, through a bounded queue.

The scheduler thread gathers a page's KV into a fresh tensor (the slots it came from may be
reused at the next step) and hands it over with :meth:`Writer.submit`; one daemon thread
drains the queue in batches (one existence check and one pipelined put per batch). When the
queue is full the page is dropped and counted: writing to storage is an optimisation, and
blocking the scheduler on a slow store would cost every running request. Results come back
through ``done`` (drained by the scheduler thread in ``poll``) as ``(tag, stored)`` pairs;
``tag`` is what the submitter attached (the cache: the page's token path, for L3 events).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from typing import Any, Deque, List, NamedTuple, Optional, Tuple

import torch

from .client import StorageClient

__all__ = ["Writer", "WriteItem"]


class WriteItem(NamedTuple):
    key: bytes
    data: torch.Tensor  # the page's KV, [layers, 2, tokens, kv_heads, head_dim]; owned by the item
    tag: Any = None


class Writer:
    def __init__(self, client: StorageClient, max_pending_pages: int = 256, batch_pages: int = 16) -> None:
        if max_pending_pages < 1:
            raise ValueError(f"max_pending_pages must be >= 1, got {max_pending_pages}")
        if batch_pages < 1:
            raise ValueError(f"batch_pages must be >= 1, got {batch_pages}")
        self.client = client
        self.batch_pages = batch_pages
        self.done: Deque[Tuple[Any, bool]] = collections.deque()
        self.dropped = 0  # pages refused because the queue was full (scheduler thread only)
        self._q: "queue.Queue[Optional[WriteItem]]" = queue.Queue(maxsize=max_pending_pages)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixserve-l3-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._q.unfinished_tasks

    def submit(self, item: WriteItem) -> bool:
        """Queue one page; False (and counted in ``dropped``) when full or closed."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def _run(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                self._q.task_done()
                return
            batch: List[WriteItem] = [first]
            stop = False
            while len(batch) < self.batch_pages:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            try:
                try:
                    res = self.client.store([(it.key, it.data) for it in batch])
                except Exception as e:  # noqa: BLE001 - a bug here must not kill the thread
                    self.client.counters.add("errors")
                    self.client.last_error = f"writer: {type(e).__name__}: {e}"
                    res = None
                self.done.extend((it.tag, res is not None and bool(res[i])) for i, it in enumerate(batch))
            finally:
                for _ in range(len(batch) + stop):  # the stop marker is a task too
                    self._q.task_done()
            if stop:
                return

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted page has been written or failed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = self._q.all_tasks_done
        with cond:
            while self._q.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=timeout)
        self._thread.join(timeout)
