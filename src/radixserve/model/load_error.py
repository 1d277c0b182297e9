"""The one exception every model/tokenizer loader raises.

It lives in its own module so that the loaders (``gguf_loader``, ``hf_loader``) and the
``registry`` that dispatches to them can all raise it without importing each other.
It subclasses ``ValueError`` because a bad model file is bad input, not a bug: callers that
already catch ``ValueError`` for user input keep working.
"""

from __future__ import annotations

import os


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike[str] | None, reason: str):
        self.path = None if path is None else os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}" if self.path is not None else reason)
