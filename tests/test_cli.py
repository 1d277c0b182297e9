"""The command line: help, generate with the tiny model, clear errors for bad values, and
``serve`` printing its URL once ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixserve.cli import build_parser, main

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_help_lists_every_engine_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--kv-cache-tokens", "--page-size", "--cache", "--policy", "--dtype",
                 "--in-batch-sharing", "--no-in-batch-sharing", "--api-key", "--log-level", "--port"):
        assert flag in out
    assert "radix,table,none" in out  # choices come from the config
    assert "KV pool capacity in tokens" in out  # help comes from FIELD_HELP


def test_module_entry_point_help() -> None:
    r = subprocess.run([sys.executable, "-m", "radixserve", "--help"], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert r.returncode == 0 and "serve" in r.stdout and "generate" in r.stdout


def test_generate_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "Hello there", "--model", "tiny-random", "--max-tokens", "6",
               "--kv-cache-tokens", "2048", "--stats"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.strip() != ""
    assert "6 generated" in captured.err
    rc = main(["generate", "Hello there", "--model", "tiny-random", "--max-tokens", "6",
               "--kv-cache-tokens", "2048", "--no-chat", "--no-in-batch-sharing"])
    assert rc == 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "hi", "--kv-cache-tokens", "-5"], "kv_cache_tokens must be an integer >= 1"),
        (["generate", "hi", "--decode-reserve-ratio", "2"], "decode_reserve_ratio"),
        (["generate", "hi", "--model", "tiny-random", "--temperature", "-1"], "temperature"),
        (["serve", "--page-size", "0"], "page_size"),
        (["serve", "--port", "70000"], "port must be an integer in [0, 65535]"),
        (["serve", "--hicache-l2-tokens", "64", "--hicache-storage", "s3://b/k"], "hicache_storage must be"),
        (["serve", "--hicache-storage-timeout-s", "0"], "hicache_storage_timeout_s"),
    ],
)
def test_bad_values_exit_2_without_traceback(argv: list[str], needle: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--cache", "lru"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_serve_prints_url_and_answers() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--model", "tiny-random", "--port", "0",
         "--kv-cache-tokens", "2048", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )
    try:
        deadline = time.monotonic() + 90
        url = None
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "http://" in line:
                url = line.split("at ", 1)[1].split()[0]
                break
        assert url, "serve did not print its URL"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_option_names_are_declared_once() -> None:
    """Cache kinds, policies and attention backends: the config's lists are the ones the
    code dispatches on (no second list to drift)."""
    from radixserve import config
    from radixserve.cache import CACHE_KINDS
    from radixserve.model.attention import _BACKENDS
    from radixserve.model.registry import DEFAULT_MODEL
    from radixserve.sched.policy import POLICY_FUNCS

    assert set(config.CACHE_KINDS) == set(CACHE_KINDS)
    assert set(config.POLICIES) == set(POLICY_FUNCS) | {"random"}
    assert set(config.ATTENTION_BACKENDS) == set(_BACKENDS)
    assert DEFAULT_MODEL == config.DEFAULT_MODEL == config.EngineConfig().model


def test_hicache_options_are_declared_once_in_engine_config() -> None:
    """HiCacheConfig is derived from EngineConfig's hicache_* fields: same defaults, a CLI
    flag and help for each, one validator (so both paths give the same error)."""
    import dataclasses

    from radixserve import storage
    from radixserve.cache.hicache import HiCacheConfig
    from radixserve.config import FIELD_HELP, EngineConfig, check_storage_url

    names = [f.name for f in dataclasses.fields(HiCacheConfig) if f.name != "model_name"]
    assert names == [n[len("hicache_"):] for n in EngineConfig.field_names() if n.startswith("hicache_")]
    derived, plain = HiCacheConfig.from_engine(EngineConfig()), HiCacheConfig()
    for n in names:
        assert getattr(derived, n) == getattr(plain, n), n
    assert derived.storage is None and derived.model_name == f"{EngineConfig.model}:{EngineConfig.dtype}"
    assert HiCacheConfig.from_engine(EngineConfig(hicache_l2_tokens=64, hicache_ghost_entries=7),
                                     model_name="m") == HiCacheConfig(l2_tokens=64, ghost_entries=7, model_name="m")
    flags = build_parser().parse_args(["serve"])
    for n in names:
        assert "hicache_" + n in FIELD_HELP and hasattr(flags, "hicache_" + n)
    assert storage.check_storage_url is check_storage_url
    for bad in ("s3://bucket/x", "file://host/x", "redis://", "relative/path"):
        with pytest.raises(ValueError) as via_engine:
            EngineConfig(hicache_l2_tokens=64, hicache_storage=bad)
        with pytest.raises(ValueError) as via_view:
            HiCacheConfig(l2_tokens=64, storage=bad)
        with pytest.raises(ValueError) as direct:
            check_storage_url(bad, "hicache_storage")
        assert str(via_engine.value) == "hicache_" + str(via_view.value) == str(direct.value)
