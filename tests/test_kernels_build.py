"""How the CPU kernels are built: loud failures, a private cache keyed by content.

The real kernels are built once per test run (``load_kernels``); the other tests build tiny
sources (no torch headers, a second or two) into temporary cache folders.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from radixserve.kernels import builder
from radixserve.kernels import library as kernels


def test_kernels_build_wherever_a_compiler_exists():
    """Skipping is only acceptable without a C++ compiler: a build that fails where one
    exists must fail the suite (with the compiler output), not hide behind a skip."""
    if not builder.kernels_expected():
        pytest.skip("no C++ compiler on this machine")
    k = kernels.load_kernels()  # raises KernelBuildError with the compiler output
    assert k.path.exists()
    assert k.path.parent.parent == builder.default_cache_dir()
    assert stat.S_IMODE(k.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(k.path.parent.parent.stat().st_mode) == 0o700
    assert kernels.load_kernels() is k  # one build per process


needs_compiler = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")


@needs_compiler
def test_build_error_carries_the_compiler_output(tmp_path: Path):
    src = tmp_path / "broken.cpp"
    src.write_text("int radixserve_probe() { return undeclared_identifier_xyz; }\n")
    with pytest.raises(kernels.KernelBuildError, match="undeclared_identifier_xyz"):
        builder.build("rs_broken", [src], cache_dir=tmp_path / "cache")


@needs_compiler
def test_build_is_cached_and_keyed_by_content(tmp_path: Path):
    src = tmp_path / "probe.cpp"
    src.write_text("extern \"C\" int radixserve_probe_a() { return 1; }\n")
    cache = tmp_path / "cache"
    lib = builder.build("rs_probe", [src], cache_dir=cache)
    assert lib.exists() and lib.parent.parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    mtime = lib.stat().st_mtime_ns
    assert builder.build("rs_probe", [src], cache_dir=cache) == lib  # cached: no rebuild
    assert lib.stat().st_mtime_ns == mtime
    src.write_text("extern \"C\" int radixserve_probe_b() { return 2; }\n")
    lib2 = builder.build("rs_probe", [src], cache_dir=cache)
    assert lib2 != lib and lib2.exists()  # new content, new key, new folder


def test_build_key_covers_sources_headers_and_flags(tmp_path: Path):
    a, h = tmp_path / "a.cpp", tmp_path / "a.h"
    a.write_text("int f();\n")
    h.write_text("#pragma once\n")
    cxx = builder.compiler() or "c++"
    if builder.compiler() is None:
        pytest.skip("no C++ compiler to version")
    k0 = builder.build_key([a, h], cxx, ("-O2",), ())
    assert builder.build_key([a, h], cxx, ("-O2",), ()) == k0
    assert builder.build_key([a, h], cxx, ("-O3",), ()) != k0
    h.write_text("#pragma once\n// changed\n")
    assert builder.build_key([a, h], cxx, ("-O2",), ()) != k0


def test_build_key_differs_between_checkouts_of_the_same_sources(tmp_path: Path):
    """torch's build.ninja holds the sources' absolute paths: two checkouts sharing a build
    folder would rebuild it for each other, so each gets its own key."""
    if builder.compiler() is None:
        pytest.skip("no C++ compiler to version")
    cxx = builder.compiler() or "c++"
    keys = []
    for checkout in ("one", "two"):
        src = tmp_path / checkout / "a.cpp"
        src.parent.mkdir()
        src.write_text("int f();\n")
        keys.append(builder.build_key([src], cxx, ("-O2",), ()))
    assert keys[0] != keys[1]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_private_dir_is_0700_and_refuses_shared_writable(tmp_path: Path):
    d = builder.private_dir(tmp_path / "x" / "y")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    builder.private_dir(loose)  # ours and only readable by others: tightened
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(kernels.KernelBuildError, match="writable"):
        builder.private_dir(shared)


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    """try_load_kernels logs the failure (with its message) once and returns None; the
    backend then runs its eager path."""
    import logging

    from radixserve.model.arch.attention_kernel import TorchAttentionBackend

    monkeypatch.setattr(kernels, "_kernels", None)
    monkeypatch.setattr(kernels, "_error", None)

    def boom(*args, **kwargs):
        raise kernels.KernelBuildError("compiler said: no such flag -mfoo")

    monkeypatch.setattr(kernels, "build", boom)
    monkeypatch.setattr(kernels, "_ops_registered", lambda: False)
    with caplog.at_level(logging.WARNING, logger="radixserve.kernels.library"):
        b1 = TorchAttentionBackend()
        b2 = TorchAttentionBackend()
    assert not b1.uses_kernels and not b2.uses_kernels
    msgs = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(msgs) == 1 and "-mfoo" in msgs[0]
    with pytest.raises(kernels.KernelBuildError, match="-mfoo"):
        TorchAttentionBackend(kernels=True)


def _build_dir(cache: Path, name: str, src: Path) -> Path:
    """The folder build() will use for ``src``, created as build() creates it."""
    key = builder.build_key([src], builder.compiler() or "c++", builder.kernel_cflags(), builder.LDFLAGS)
    return builder.private_dir(builder.private_dir(cache) / f"{name}_{key}")


@needs_compiler
def test_a_torch_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path: Path):
    """torch waits forever while its ``lock`` file exists; a build killed halfway leaves one.
    The next build removes it (it holds the folder's flock, so no live builder owns it)."""
    src = tmp_path / "probe.cpp"
    src.write_text("extern \"C\" int radixserve_probe_stale() { return 3; }\n")
    cache = tmp_path / "cache"
    folder = _build_dir(cache, "rs_stale", src)
    (folder / "lock").touch()  # what torch's FileBaton leaves when its process is killed
    result: dict[str, Path] = {}
    t = threading.Thread(target=lambda: result.setdefault("lib", builder.build("rs_stale", [src], cache_dir=cache)),
                         daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the build waited on a dead builder's lock"
    assert result["lib"].parent == folder and result["lib"].exists()
    assert not (folder / "lock").exists()


@needs_compiler
def test_a_builder_killed_while_holding_the_lock_releases_it(tmp_path: Path):
    """The folder's lock is an flock: SIGKILL of its holder frees it for the next build,
    which waits while the holder lives."""
    src = tmp_path / "probe.cpp"
    src.write_text("extern \"C\" int radixserve_probe_killed() { return 4; }\n")
    cache = tmp_path / "cache"
    folder = _build_dir(cache, "rs_killed", src)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from radixserve.kernels.builder import BuildLock\n"
         "with BuildLock(Path(sys.argv[1])):\n"
         "    (Path(sys.argv[1]) / 'lock').touch(); print('held', flush=True); time.sleep(600)\n",
         str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result: dict[str, Path] = {}
        t = threading.Thread(target=lambda: result.setdefault("lib", builder.build("rs_killed", [src], cache_dir=cache)),
                             daemon=True)
        t.start()
        t.join(2)
        assert t.is_alive(), "the build did not wait for the live holder"
        holder.send_signal(signal.SIGKILL)
        t.join(120)
        assert not t.is_alive() and result["lib"].parent == folder and result["lib"].exists()
    finally:
        holder.kill()
        holder.wait()


DAY = 86400.0


def _fake_build(root: Path, name: str, used_days_ago: float, now: float, marker: bool = True) -> Path:
    d = root / name
    d.mkdir(mode=0o700)
    (d / f"{name}.so").write_bytes(b"\0" * 64)
    when = now - used_days_ago * DAY
    if marker:
        (d / builder.StaleBuilds.MARKER).touch()
        os.utime(d / builder.StaleBuilds.MARKER, (when, when))
    os.utime(d / f"{name}.so", (when, when))
    os.utime(d, (when, when))
    return d


def test_stale_builds_go_and_recent_ones_stay(tmp_path: Path):
    """Of a library's other builds, the keep - 1 most recently used stay whatever their age,
    and so does any used within max_age; the rest go. The current build, other libraries'
    folders and plain files are never touched; a build from before markers is aged by its
    library's time."""
    now = 1_000 * DAY
    cur = _fake_build(tmp_path, "lib_cur", 0, now)
    ages = {"lib_a": 1, "lib_b": 20, "lib_c": 30, "lib_d": 3, "lib_e": 40, "lib_f": 50}
    dirs = {n: _fake_build(tmp_path, n, a, now) for n, a in ages.items()}
    dirs["lib_old"] = _fake_build(tmp_path, "lib_old", 60, now, marker=False)
    other = _fake_build(tmp_path, "otherlib_x", 90, now)
    (tmp_path / "lib_file").write_text("not a build")
    stale = builder.StaleBuilds(tmp_path, "lib", keep=3, max_age_s=14 * DAY)
    assert [d.name for d in stale.builds()][:3] == ["lib_cur", "lib_a", "lib_d"]
    removed = stale.prune(cur, now=now)
    # kept: cur, the two most recent others (a, d); b..f and old are past 14 days
    assert sorted(d.name for d in removed) == ["lib_b", "lib_c", "lib_e", "lib_f", "lib_old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib_a", "lib_cur", "lib_d", "lib_file", "otherlib_x"]
    assert other.exists() and cur.exists()
    with pytest.raises(ValueError, match="keep"):
        builder.StaleBuilds(tmp_path, "lib", keep=0)


def test_a_build_in_progress_is_not_removed(tmp_path: Path):
    """A stale folder whose BuildLock another holder has (a process building into it) stays;
    once the lock is released, the next prune removes it."""
    now = 1_000 * DAY
    cur = _fake_build(tmp_path, "lib_cur", 0, now)
    busy = _fake_build(tmp_path, "lib_busy", 30, now)
    stale = builder.StaleBuilds(tmp_path, "lib", keep=1, max_age_s=DAY)
    with builder.BuildLock(busy):
        assert stale.prune(cur, now=now) == []
        assert busy.exists()
    assert stale.prune(cur, now=now) == [busy] and not busy.exists()


@needs_compiler
def test_a_new_build_prunes_the_old_and_marks_itself_used(tmp_path: Path):
    """build() marks the library it loads as used, and after compiling a new one removes the
    same library's builds that are both unused for weeks and not among the most recent."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    now = time.time()
    old = [_fake_build(cache, f"rs_tidy_{i:020x}", 30 + i, now) for i in range(12)]
    src = tmp_path / "tidy.cpp"
    src.write_text("extern \"C\" int radixserve_probe_tidy() { return 3; }\n")
    lib = builder.build("rs_tidy", [src], cache_dir=cache)
    marker = lib.parent / builder.StaleBuilds.MARKER
    assert marker.exists() and now - 5 <= marker.stat().st_mtime
    kept = [d for d in old if d.exists()]
    assert kept == old[:7]  # the seven most recently used of the old, with the new one: eight
