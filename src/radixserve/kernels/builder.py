"""Building the CPU kernels of ``kernels/csrc/`` (C++) with torch's extension machinery.

How they are built: ``torch.utils.cpp_extension.load`` (torch's compiler flags, headers and
OpenMP runtime; ``ninja`` drives the compiler), once per machine, into a private cache
folder (created with mode 0700, refused if another user owns it or others can write to it)
named by a hash of everything the binary depends on: the sources, the compiler and its
version, the flags, the torch version and the CPU's instruction set (the code is built for
the CPU it runs on). A second process, or a later run, loads the cached binary.

Concurrent and interrupted builds: torch guards a build folder with a ``lock`` file that it
creates and deletes, and waits forever while one exists, so a build killed halfway (Ctrl-C,
the OOM killer, a CI timeout) would hang every later start on that machine. :class:`BuildLock`
holds an ``flock`` on the folder for the whole build instead (the kernel drops it when its
process dies); holding it, any torch ``lock`` left in the folder is a dead builder's and is
removed before torch looks.

Old builds: every change of the sources (an upgrade, another checkout) builds into a new
folder and nothing reads the old ones again. :class:`StaleBuilds` removes them after a new
build lands, keeping the most recently used ones and any used lately.

Failure is loud: :func:`build` raises :class:`KernelBuildError` with the compiler's output;
``kernels_expected()`` tells a test whether a failure is acceptable (no compiler here) or a bug.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import time
from pathlib import Path

import torch

from radixserve.kernels.isa import host_isa, process_capped

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "attention.cpp", "attention_avx2.cpp", "attention_avx512.cpp", "layer_ops.cpp",
           "gemm.cpp", "gemm_dot.cpp", "gemm_quant.cpp", "gemm_q8dot.cpp",
           "gemm_codes.cpp")
HEADERS = ("common.h", "attention.h", "simd_avx2.h", "gemm_dot.h", "quant.h", "tiles.h")
# -ffp-contract=off: a * b + c stays two roundings unless the code asks for a fused
# multiply-add, so the vectorised and portable paths (and the eager RoPE) agree bit for bit.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
# The instruction set a process capped by $RADIXSERVE_CPU_ISA builds for, in place of the
# host's: what an AVX2-only (x86-64-v3: AVX2, FMA, F16C, BMI) or a pre-AVX2 x86 CPU compiles,
# so a capped process runs the binary such a machine builds — the AVX-512 paths are not in it
# at all, and the compiler's own vectorisation of the portable loops stays at that level too.
# At the avx512 level (an AMX CPU capped) the build stays -march=native: the tile code is
# inline assembly that the compiler never emits by itself, and the level picks at run time.
CAPPED_MARCH = {"avx512": "-march=native", "avx2": "-march=x86-64-v3", "generic": "-march=x86-64"}


def kernel_cflags() -> tuple[str, ...]:
    """The compiler flags of this process's build: ``-march=native``, unless ``$RADIXSERVE_CPU_ISA``
    caps the process below an x86 CPU's level (:func:`~radixserve.kernels.isa.host_isa`); then the
    flags of a CPU at that level (``CAPPED_MARCH``). ``EngineConfig.cpu_isa`` does not change the
    build (one library per process): it picks among the paths the build has, at run time."""
    if process_capped() and platform.machine() in ("x86_64", "AMD64"):
        return tuple(CAPPED_MARCH[host_isa()] if f == "-march=native" else f for f in CFLAGS)
    return CFLAGS


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message carries the compiler output."""


def compiler() -> str | None:
    """The C++ compiler torch's extension builder would call (``$CXX``, else ``c++``)."""
    return shutil.which(os.environ.get("CXX", "c++"))


def kernels_expected() -> bool:
    """Whether this machine should be able to build the kernels (a CPU build of torch, a
    C++ compiler). Where it is True, a build failure is a bug, not a missing tool."""
    return compiler() is not None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve" / "kernels"


def _cpu_isa() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    sig = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part", "cpu family", "model\t")):
                    sig.append(line.strip())
                if not line.strip():
                    break
    except OSError:
        sig.append(platform.processor())
    return "\n".join(sig)


def _compiler_version(cxx: str) -> str:
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    return proc.stdout + proc.stderr


def build_key(sources: list[Path], cxx: str, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """Hash of everything the built binary depends on (see the module docstring), and of
    where the sources are: torch's build.ninja records their absolute paths, so two checkouts
    of the same sources sharing one build folder would rebuild it for each other in turn."""
    parts = [*sorted({str(src.resolve().parent) for src in sources}), cxx, _compiler_version(cxx),
             " ".join(cflags), " ".join(ldflags), torch.__version__, _cpu_isa()]
    h = hashlib.sha256()
    for part in [p.encode() for p in parts] + [b for src in sources for b in (src.name.encode(), src.read_bytes())]:
        h.update(part)
        h.update(b"\0")  # every part ends with a NUL: no two sequences of parts hash alike
    return h.hexdigest()[:20]


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, or check an existing one. An existing
    folder must belong to this user and not be writable by anyone else: a shared-writable cache
    would let another user plant the library this process loads."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelBuildError(f"kernel cache {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelBuildError(f"kernel cache {path} is writable by group/others "
                               f"(mode {oct(st.st_mode & 0o777)}); chmod 700 it")
    if st.st_mode & 0o077:  # readable by others: tighten what we own
        os.chmod(path, 0o700)
    return path


class BuildLock:
    """Exclusive right to build into one cache folder, held by an ``flock`` that dies with
    its process. Entering it clears torch's own ``lock`` file if a killed builder left one
    (see the module docstring): no live radixserve builder can hold that file while this
    lock is held."""

    LOCK_NAME = ".radixserve-build.lock"
    TORCH_BATON = "lock"

    def __init__(self, build_dir: Path, wait: bool = True) -> None:
        self.build_dir = build_dir
        self.wait = wait  # False: entering raises BlockingIOError while another process holds it
        self._fd: int | None = None

    def __enter__(self) -> BuildLock:
        fd = os.open(self.build_dir / self.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or not self.wait:
                    raise
                log.info("waiting for another process building the kernels in %s", self.build_dir)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        baton = self.build_dir / self.TORCH_BATON
        if baton.exists():
            log.warning("removing %s left by a kernel build that did not finish", baton)
            baton.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class StaleBuilds:
    """The builds of one library in a cache folder that nothing is expected to load again.

    Each build is a folder of several megabytes, and a new one appears with every change of the
    sources, so without this the cache grows with every upgrade. A build counts as used when a
    process loads it (:meth:`mark_used` touches its marker); after a new build lands, every other
    build of the same library is removed unless it is among the ``keep`` most recently used
    (the new one included) or was used within ``max_age_s``. A build whose :class:`BuildLock`
    another process holds (it is being built) is left alone, and a process that has a removed
    build loaded keeps running on its mapping."""

    MARKER = ".last-used"

    def __init__(self, root: Path, name: str, keep: int = 8, max_age_s: float = 14 * 86400) -> None:
        if keep < 1 or max_age_s < 0:
            raise ValueError(f"keep must be at least 1 and max_age_s not negative, got {keep}, {max_age_s}")
        self.root = root
        self.name = name
        self.keep = keep
        self.max_age_s = max_age_s

    @classmethod
    def mark_used(cls, build_dir: Path) -> None:
        try:
            (build_dir / cls.MARKER).touch()
        except OSError as e:  # a read-only cache still loads
            log.debug("could not mark %s used: %s", build_dir, e)

    def last_used(self, build_dir: Path) -> float:
        """When a process last loaded the build (its folder's time for one from before markers)."""
        for p in (build_dir / self.MARKER, build_dir / f"{build_dir.name}.so", build_dir):
            try:
                return p.stat().st_mtime
            except OSError:
                continue
        return 0.0

    def builds(self) -> list[Path]:
        """This library's build folders in the cache, most recently used first."""
        prefix = f"{self.name}_"
        found = [d for d in self.root.iterdir()
                 if d.name.startswith(prefix) and d.is_dir() and not d.is_symlink()]
        return sorted(found, key=self.last_used, reverse=True)

    def prune(self, current: Path, now: float | None = None) -> list[Path]:
        """Removes the stale builds other than ``current``; returns those removed."""
        now = time.time() if now is None else now
        others = [d for d in self.builds() if d.resolve() != current.resolve()]
        removed = []
        for d in others[self.keep - 1:]:
            if now - self.last_used(d) <= self.max_age_s:
                continue
            try:
                with BuildLock(d, wait=False):
                    shutil.rmtree(d)
            except BlockingIOError:
                continue  # another process is building it
            except OSError as e:
                log.warning("could not remove the old kernel build %s: %s", d, e)
                continue
            removed.append(d)
        if removed:
            log.info("removed %d old kernel build(s) from %s", len(removed), self.root)
        return removed


def build(name: str, sources: list[Path], headers: tuple[Path, ...] = (),
          cache_dir: Path | None = None, cflags: tuple[str, ...] | None = None,
          ldflags: tuple[str, ...] = LDFLAGS) -> Path:
    """Compile ``sources`` into ``<cache>/<name>_<key>/`` unless already built there, load
    the library into this process (registering its operators) and return its path.

    Raises KernelBuildError (with the compiler's output) when anything fails."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found ($CXX or c++)")
    cflags = kernel_cflags() if cflags is None else cflags
    from torch.utils import cpp_extension

    key = build_key([*sources, *headers], cxx, cflags, ldflags)
    root = private_dir(cache_dir or default_cache_dir())
    full = f"{name}_{key}"
    build_dir = private_dir(root / full)
    lib = build_dir / f"{full}.so"
    fresh = not lib.exists()
    global last_build_seconds
    last_build_seconds = None
    t0 = time.perf_counter()
    try:
        with BuildLock(build_dir):
            cpp_extension.load(name=full, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                               extra_ldflags=list(ldflags), extra_include_paths=[str(s.parent) for s in sources[:1]],
                               build_directory=str(build_dir), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building {full} failed (compiler {cxx}):\n{e}") from e
    StaleBuilds.mark_used(build_dir)
    if fresh:
        last_build_seconds = time.perf_counter() - t0
        log.info("built %s in %.1f s (%s)", full, last_build_seconds, build_dir)
        try:
            StaleBuilds(root, name).prune(build_dir)
        except OSError as e:  # the new build loaded; a cache that cannot be tidied is no failure
            log.warning("could not look for old kernel builds in %s: %s", root, e)
    return lib


# Seconds the last build() spent compiling (None when it found the library in the cache).
last_build_seconds: float | None = None
