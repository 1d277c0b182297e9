"""Background reads of a request's pages from L3, while the request waits in the queue.

The scheduler thread submits a :class:`PrefetchJob` (the keys of the pages the local tiers do
not hold, in chain order) and goes on; one worker thread asks the store which exist (one
batched call), then reads them a few at a time, appending each page that passes its checks
to ``job.pages``. The scheduler thread reads ``job.pages`` once the request has waited enough
(the prefetch policy) and may cancel the rest (checked between batches: at most one more).
Only the worker appends to ``pages`` and only the scheduler thread reads it; a list append
is atomic in CPython, and a snapshot (``len`` then slice) never sees a half-appended page.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import List, Optional, Sequence

from .client import StorageClient
from .objects import DecodedPage

__all__ = ["PrefetchJob", "Prefetcher"]


class PrefetchJob:
    __slots__ = ("keys", "pages", "present", "cancelled", "done", "t_submit", "t_done")

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys: List[bytes] = list(keys)
        self.pages: List[DecodedPage] = []
        #: How many of ``keys`` (from the first) the store said it holds; None until known.
        self.present: Optional[int] = None
        self.cancelled = False
        self.done = threading.Event()
        self.t_submit = time.monotonic()
        self.t_done: Optional[float] = None

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.done.wait(timeout)

    def _finish(self) -> None:
        self.t_done = time.monotonic()
        self.done.set()


class Prefetcher:
    """One daemon thread serving prefetch jobs in submission order."""

    def __init__(self, client: StorageClient, batch_pages: int = 4, max_pending: int = 1024) -> None:
        if batch_pages < 1:
            raise ValueError(f"batch_pages must be >= 1, got {batch_pages}")
        self.client = client
        self.batch_pages = batch_pages
        self._q: "queue.Queue[Optional[PrefetchJob]]" = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="radixserve-prefetch", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, job: PrefetchJob) -> bool:
        """Queue ``job``; False (job finished empty) if the queue is full or closed."""
        if self._closed:
            job._finish()
            return False
        try:
            self._q.put_nowait(job)
        except queue.Full:
            job._finish()
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - a bug here must not kill the thread
                self.client.counters.add("errors")
                self.client.last_error = f"prefetcher: {type(e).__name__}: {e}"
            finally:
                job._finish()

    def _serve(self, job: PrefetchJob) -> None:
        if job.cancelled:
            return
        n = self.client.count_present(job.keys)
        job.present = n
        i = 0
        b = self.batch_pages
        while i < n and not job.cancelled:
            want = job.keys[i : i + b]
            got = self.client.fetch(want)
            for page in got:
                job.pages.append(page)
            if len(got) < len(want):
                return
            i += b

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        while True:  # unblock the worker even if the queue is full of stale jobs
            try:
                stale = self._q.get_nowait()
            except queue.Empty:
                break
            if stale is not None:
                stale.cancelled = True
                stale._finish()
        self._q.put(None)
        self._thread.join(timeout)
