"""L3 in a local directory: one file per page (``file:///path``).

Files are named by the key's hex digest under a two-hex-digit fan-out directory (``ab/abcd…``)
so no directory grows past a few thousand entries. A write goes to a temporary file in the
same directory, renamed into place (atomic on POSIX): a reader (another server on the disk,
a restarted one) sees the old object, the new one or none, never a partial write. A crash
can leave a temporary file, never read (its name has no key); ``sweep_temporaries`` removes
old ones. No size bound: point it at a disk with room, or prune it by age (any file may be
deleted at any time; it is a miss).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .base import StorageBackend

__all__ = ["FileStorage"]

_SUFFIX = ".kv"
_TMP = ".tmp-"


class FileStorage(StorageBackend):
    def __init__(self, root: str | os.PathLike) -> None:
        if not str(root):
            raise ValueError("root must be a directory path, got ''")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise ValueError(f"root {str(self.root)!r} is not a directory")
        self.url = self.root.resolve().as_uri()
        self._seq = 0
        self._lock = threading.Lock()

    def path_for(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + _SUFFIX)

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        return [self.path_for(k).is_file() for k in keys]

    def get(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        out: List[Optional[bytes]] = []
        for k in keys:
            try:
                with open(self.path_for(k), "rb") as f:
                    out.append(f.read())
            except FileNotFoundError:
                out.append(None)
        return out

    def put(self, items: Sequence[Tuple[bytes, bytes]]) -> None:
        for key, blob in items:
            path = self.path_for(key)
            path.parent.mkdir(exist_ok=True)
            with self._lock:
                self._seq += 1
                seq = self._seq
            tmp = path.parent / f"{_TMP}{os.getpid()}-{threading.get_ident()}-{seq}"
            try:
                with open(tmp, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def sweep_temporaries(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files older than ``older_than_s`` left by crashed writers."""
        cutoff = time.time() - older_than_s
        removed = 0
        for tmp in self.root.glob(f"*/{_TMP}*"):
            with contextlib.suppress(OSError):
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    removed += 1
        return removed
