"""How the CPU kernels are built: loud failures, a private cache keyed by content.

The real kernels are built once per test run (``load_kernels``); the other tests build tiny
sources (no torch headers, a second or two) into temporary cache folders.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from radixserve.kernels import library as kernels


def test_kernels_build_wherever_a_compiler_exists():
    """Skipping is only acceptable without a C++ compiler: a build that fails where one
    exists must fail the suite (with the compiler output), not hide behind a skip."""
    if not kernels.kernels_expected():
        pytest.skip("no C++ compiler on this machine")
    k = kernels.load_kernels()  # raises KernelBuildError with the compiler output
    assert k.path.exists()
    assert k.path.parent.parent == kernels.default_cache_dir()
    assert stat.S_IMODE(k.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(k.path.parent.parent.stat().st_mode) == 0o700
    assert kernels.load_kernels() is k  # one build per process


needs_compiler = pytest.mark.skipif(not kernels.kernels_expected(), reason="no C++ compiler")


@needs_compiler
def test_build_error_carries_the_compiler_output(tmp_path: Path):
    src = tmp_path / "broken.cpp"
    src.write_text("int radixserve_probe() { return undeclared_identifier_xyz; }\n")
    with pytest.raises(kernels.KernelBuildError, match="undeclared_identifier_xyz"):
        kernels.build("rs_broken", [src], cache_dir=tmp_path / "cache")


@needs_compiler
def test_build_is_cached_and_keyed_by_content(tmp_path: Path):
    src = tmp_path / "probe.cpp"
    src.write_text("extern \"C\" int radixserve_probe_a() { return 1; }\n")
    cache = tmp_path / "cache"
    lib = kernels.build("rs_probe", [src], cache_dir=cache)
    assert lib.exists() and lib.parent.parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    mtime = lib.stat().st_mtime_ns
    assert kernels.build("rs_probe", [src], cache_dir=cache) == lib  # cached: no rebuild
    assert lib.stat().st_mtime_ns == mtime
    src.write_text("extern \"C\" int radixserve_probe_b() { return 2; }\n")
    lib2 = kernels.build("rs_probe", [src], cache_dir=cache)
    assert lib2 != lib and lib2.exists()  # new content, new key, new folder


def test_build_key_covers_sources_headers_and_flags(tmp_path: Path):
    a, h = tmp_path / "a.cpp", tmp_path / "a.h"
    a.write_text("int f();\n")
    h.write_text("#pragma once\n")
    cxx = kernels.compiler() or "c++"
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler to version")
    k0 = kernels.build_key([a, h], cxx, ("-O2",), ())
    assert kernels.build_key([a, h], cxx, ("-O2",), ()) == k0
    assert kernels.build_key([a, h], cxx, ("-O3",), ()) != k0
    h.write_text("#pragma once\n// changed\n")
    assert kernels.build_key([a, h], cxx, ("-O2",), ()) != k0


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_private_dir_is_0700_and_refuses_shared_writable(tmp_path: Path):
    d = kernels.private_dir(tmp_path / "x" / "y")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    kernels.private_dir(loose)  # ours and only readable by others: tightened
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(kernels.KernelBuildError, match="writable"):
        kernels.private_dir(shared)


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    """try_load_kernels logs the failure (with its message) once and returns None; the
    backend then runs its eager path."""
    import logging

    from radixserve.model.attention import TorchAttentionBackend

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
