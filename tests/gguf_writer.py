"""A GGUF writer for tests: the inverse of ``radixserve.model.loaders.gguf_loader.load_gguf``.

Written the way llama.cpp's converter writes (names, q/k permutation, 1-D tensors in F32),
so the loader can be tested against a known state dict. It lives with the tests because
nothing in the engine writes GGUF.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from radixserve.model.model_config import ModelConfig
from radixserve.model.loaders.gguf_loader import _GLOBAL_NAMES, _layer_names
from radixserve.model.tokenization.tokenizer import TokenizerSpec


_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)$")


def hf_name_to_gguf(name: str, arch: str = "llama") -> str | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``: the loader's
    name map (``gguf_name_to_hf``) read backwards, for writing test files."""
    m = _HF_LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        g = {v: k for k, v in _layer_names(arch).items()}.get(part)
        return None if g is None else f"blk.{layer}.{g}.{kind}"
    base, _, kind = name.rpartition(".")
    g = {v: k for k, v in _GLOBAL_NAMES.items()}.get(base)
    return None if g is None else f"{g}.{kind}"


def permute_qk(w: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """HF rotate-half row order -> llama.cpp interleaved order (what its converter does); the
    inverse of ``gguf_loader.unpermute_qk``."""
    d = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(d, *rest)


def write_gguf(
    path: str | os.PathLike[str],
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer_spec: TokenizerSpec | None,
    *,
    dtype: str = "f32",
    name: str = "radixserve-model",
    quant: dict[str, str] | None = None,
) -> None:
    """Write a llama/qwen2 GGUF the way llama.cpp's converter would (names, q/k permutation,
    1-D tensors in F32), so :func:`load_gguf` can be tested against a known state dict.

    ``dtype`` is ``"f32"`` or ``"f16"`` for the 2-D weights. ``quant``: GGUF block types by
    a part of the HF name (``{"q_proj": "Q4_0", "embed_tokens": "Q8_0"}``; the first key found
    in a name wins), quantized by the ``gguf`` package as llama.cpp's quantizer would.
    """
    import gguf

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    arch = config.arch
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name(name)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    if config.head_dim * config.num_heads != config.hidden_size:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(float(config.rope_theta))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    if config.rope_scaling is not None:
        rs = config.rope_scaling
        if rs.get("rope_type", rs.get("type")) != "linear":
            raise ValueError(f"cannot write rope_scaling {rs!r} to GGUF (only linear)")
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))

    if tokenizer_spec is not None:
        s = tokenizer_spec
        w.add_tokenizer_model(s.model)
        if s.pre is not None:
            w.add_tokenizer_pre(s.pre)
        w.add_token_list(s.tokens)
        if s.token_types is not None:
            w.add_token_types(s.token_types)
        if s.merges:
            w.add_token_merges(s.merges)
        for value, adder in (
            (s.bos_token_id, w.add_bos_token_id),
            (s.eos_token_id, w.add_eos_token_id),
            (s.unk_token_id, w.add_unk_token_id),
            (s.pad_token_id, w.add_pad_token_id),
        ):
            if value is not None:
                adder(value)
        w.add_add_bos_token(bool(s.add_bos_token))
        if s.chat_template is not None:
            w.add_chat_template(s.chat_template)

    for hf, tensor in state_dict.items():
        if config.tie_word_embeddings and hf == "lm_head.weight":
            continue
        g = hf_name_to_gguf(hf)
        if g is None:
            raise ValueError(f"cannot map tensor {hf!r} to a GGUF name")
        arr = tensor.detach().to(torch.float32).cpu().numpy()
        if arch == "llama":
            if ".self_attn.q_proj." in hf:
                arr = permute_qk(arr, config.num_heads)
            elif ".self_attn.k_proj." in hf:
                arr = permute_qk(arr, config.num_kv_heads)
        arr = np.ascontiguousarray(arr)
        qtype = next((t for key, t in (quant or {}).items() if key in hf), None)
        if qtype is not None and arr.ndim == 2:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(arr, t), raw_shape=gguf.quant_shape_to_byte_shape(arr.shape, t),
                         raw_dtype=t)
            continue
        if dtype == "f16" and arr.ndim >= 2:
            arr = arr.astype(np.float16)
        w.add_tensor(g, arr)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(path: str | os.PathLike[str], chat_template: str | None) -> None:
    """The tiny random model (seed 0) as a GGUF whose tokenizer ships ``chat_template``
    (None: no template, as a base model's file)."""
    import dataclasses

    from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
    from radixserve.model.testing.tiny_tokenizer import byte_level_spec

    cfg = tiny_random_config()
    spec = dataclasses.replace(byte_level_spec(cfg.vocab_size), chat_template=chat_template)
    write_gguf(path, cfg, tiny_random_state_dict(0, cfg), spec)


#: The tiny model's tensors in several GGUF block formats: a fused q/k/v of three (two
#: segments in one weight), every 32-block format, a Q8_0 embedding (the tied lm_head).
TINY_QUANT = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q5_0",
              "up_proj": "Q5_1", "down_proj": "Q4_0", "embed_tokens": "Q8_0"}


def write_tiny_quant_gguf(path: str | os.PathLike[str]) -> None:
    """The tiny random model (seed 0) as a GGUF of quantized blocks (:data:`TINY_QUANT`)."""
    from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
    from radixserve.model.testing.tiny_tokenizer import byte_level_spec

    cfg = tiny_random_config()
    write_gguf(path, cfg, tiny_random_state_dict(0, cfg), byte_level_spec(cfg.vocab_size), quant=TINY_QUANT)
