"""The command line: help, generate with the tiny model, clear errors for bad values, and
``serve`` printing its URL once ready."""

from __future__ import annotations

import logging

import os
import re
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
    # tiny-random's tokenizer ships ChatML as its own template (as SmolLM2's does): chat.
    assert ("tiny-random ships a chat template: the prompt is sent as a user message; "
            "--no-chat sends it as raw text") in captured.err
    rc = main(["generate", "Hello there", "--model", "tiny-random", "--max-tokens", "6",
               "--kv-cache-tokens", "2048", "--no-chat", "--no-in-batch-sharing"])
    assert rc == 0


def _prompt_tokens(err: str) -> int:
    m = re.search(r"\[(\d+) prompt tokens", err)
    assert m, err
    return int(m.group(1))


def test_generate_sends_raw_text_to_a_model_without_a_chat_template(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from radixserve.model.registry import load_tokenizer
    from gguf_writer import write_tiny_gguf

    base = str(tmp_path / "base.gguf")
    write_tiny_gguf(base, chat_template=None)
    tok = load_tokenizer(base)
    assert tok.chat_template is None and tok.chat_template_builtin
    run = ["generate", "Hello there", "--model", base, "--max-tokens", "2", "--kv-cache-tokens", "512", "--stats"]
    assert main(run) == 0
    err = capsys.readouterr().err
    assert (f"{base} ships no chat template (a base model): the prompt is sent as raw text; "
            "--chat forces the ChatML template\n") in err
    assert _prompt_tokens(err) == len(tok.encode_prompt("Hello there"))
    # --chat forces the built-in template, and says nothing about choosing.
    assert main([*run, "--chat"]) == 0
    err = capsys.readouterr().err
    assert "ships" not in err
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert _prompt_tokens(err) == len(tok.encode(text)) > len(tok.encode_prompt("Hello there"))
    # A system message needs chat mode: a clear error, not a silently dropped message.
    assert main([*run, "--system", "Be brief."]) == 2
    assert "--system is a chat message: add --chat to use the ChatML template" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "tiny-random", "--no-chat", "--system", "x"]) == 2
    assert "--system is a chat message: it cannot go with --no-chat" in capsys.readouterr().err


def test_a_model_that_ships_its_template_is_not_builtin(tmp_path: Path) -> None:
    from radixserve.chat_template import CHATML_TEMPLATE
    from radixserve.model.registry import load_tokenizer
    from gguf_writer import write_tiny_gguf

    own = tmp_path / "own.gguf"
    write_tiny_gguf(own, chat_template=CHATML_TEMPLATE)
    tok = load_tokenizer(str(own))
    assert tok.chat_template == CHATML_TEMPLATE and not tok.chat_template_builtin


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_generate_smollm2_chats_by_default(capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    """SmolLM2-135M-Instruct ships its chat template: the question goes as a user turn; Paris in
    every dtype."""
    from fixtures_smollm2 import require_smollm2

    require_smollm2()
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "30", "--dtype", dtype,
               "--kv-cache-tokens", "1024", "--no-install-model"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() == "The capital of France is Paris."
    assert "smollm2-135m ships a chat template: the prompt is sent as a user message" in err


@pytest.mark.parametrize("weights", ["gguf", "auto"])
def test_generate_smollm2_on_its_quantized_blocks(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
                                                  weights: str) -> None:
    """SmolLM2's Q4_1 blocks (and Q8_0 embedding) computed directly, asked for or by default on
    a bfloat16 model with native bfloat16 dot products: Paris, and the log says which weights
    served."""
    from fixtures_smollm2 import require_smollm2

    require_smollm2()
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "30", "--dtype", "bfloat16",
               "--weight-dtype", weights, "--kv-cache-tokens", "1024", "--no-install-model"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() == "The capital of France is Paris."
    from radixserve.kernels.isa import native_bf16

    if weights == "auto" and not native_bf16():  # emulated dot products: the rule keeps it dense
        assert "weights dense" in caplog.text
        return
    if weights == "auto":  # the Q8_0 embedding / lm_head on its codes, the Q4_1 layers expanded
        assert "weights gguf-codes" in caplog.text and "quantized blocks (Q8_0/codes, Q4_1)" in caplog.text
        return
    assert "weights gguf" in caplog.text and "quantized blocks (Q8_0, Q4_1)" in caplog.text


def test_generate_smollm2_on_integer_dot_products(capsys: pytest.CaptureFixture[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """--weight-dtype gguf-q8 (8-bit activations, as llama.cpp computes these blocks): NOT Paris.
    The dense model puts "The" 0.069 above "L" at the first token; 8-bit activations move that
    by ~0.1-0.2 and the answer becomes llama.cpp's own for this file ("L'Étoile, la
    Marseillaise, la femme au roi, la": llama-server 0.3.36's build, same GGUF, greedy, one
    thread, checked by hand, not here). The path is exact to its definition at every level, so
    the words are fixed: a change in them is a change in the arithmetic."""
    from fixtures_smollm2 import require_smollm2

    require_smollm2()
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "20", "--dtype", "bfloat16",
               "--weight-dtype", "gguf-q8", "--kv-cache-tokens", "1024", "--no-install-model"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip().startswith("L'Étoile, la Marseillaise"), out
    assert "weights gguf-q8" in caplog.text and "quantized blocks (Q8_0/q8, Q4_1/q8)" in caplog.text


def test_generate_smollm2_on_block_codes(capsys: pytest.CaptureFixture[str],
                                         caplog: pytest.LogCaptureFixture) -> None:
    """--weight-dtype gguf-codes (bfloat16 activations against the block codes, the scale per
    block): Paris, as the dense model answers, and the log says which weights served."""
    from fixtures_smollm2 import require_smollm2

    require_smollm2()
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "30", "--dtype", "bfloat16",
               "--weight-dtype", "gguf-codes", "--kv-cache-tokens", "1024", "--no-install-model"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() == "The capital of France is Paris."
    assert "weights gguf-codes" in caplog.text and "quantized blocks (Q8_0/codes, Q4_1/codes)" in caplog.text


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
        (["serve", "--chat-template", "/no/such/template.jinja"], "chat_template: no such file"),
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
    from radixserve.model.arch.attention import _BACKENDS
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
