"""Read (and, for tests, write) GGUF files of the llama and qwen2 architectures.

A GGUF holds three things we need: the hyper-parameters (``{arch}.*`` metadata), the weights
(possibly quantized; we dequantize to float32 with the ``gguf`` package, since our model runs
dense matmuls) and the tokenizer (``tokenizer.ggml.*`` + ``tokenizer.chat_template``).

Two conversions undo what llama.cpp's ``convert_hf_to_gguf.py`` did, so the result is a state
dict in Hugging Face naming and layout, interchangeable with one from safetensors:

* tensor names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` etc.
* q/k row order: for the llama arch the converter permutes the rows of q_proj/k_proj from HF's
  rotate-half RoPE layout to GGML's interleaved-pairs layout. Our attention (like HF) rotates
  halves, so we permute back; without it the very first generated token is already wrong.
  qwen2 files are not permuted (llama.cpp runs them with NEOX, i.e. rotate-half, RoPE).

GGUF stores a tensor's shape fastest-dimension first (``[in, out]``); numpy/torch list it
slowest first (``[out, in]``), so the numpy shape is the reversed GGUF shape.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.errors import ModelLoadError
from radixserve.model.tokenizer import TokenizerSpec

SUPPORTED_ARCHS = ("llama", "qwen2")
GGUF_MAGIC = b"GGUF"

# GGUF tensor-name suffix (after "blk.N.") -> HF name suffix (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_HF_LAYER_TO_GGUF = {v: k for k, v in _LAYER_NAMES.items()}
_HF_GLOBAL_TO_GGUF = {v: k for k, v in _GLOBAL_NAMES.items()}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)$")


@dataclass
class GGUFModel:
    """What a GGUF file describes, in our terms."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # float32, HF names and layout
    tokenizer_spec: TokenizerSpec | None
    name: str | None  # general.name
    metadata: dict[str, Any]  # every scalar/string metadata value (arrays left out)


# ---- q/k permutation ------------------------------------------------------------------------


def unpermute_qk(w: np.ndarray | torch.Tensor, n_head: int) -> Any:
    """llama.cpp's interleaved q/k row order (its converter permutes them) -> HF rotate-half
    order."""
    d = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, d // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(d, *rest)


# ---- reading --------------------------------------------------------------------------------


def _open_reader(path: str):  # -> gguf.GGUFReader
    """Open ``path`` with the gguf reader, turning every way a file can be bad into a
    :class:`ModelLoadError` that names the file and says what is wrong."""
    import gguf

    if not os.path.exists(path):
        raise ModelLoadError(path, "file not found")
    if not os.path.isfile(path):
        raise ModelLoadError(path, "not a regular file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            path, f"not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r}); corrupted or wrong format"
        )
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:
        # numpy/struct errors when the header or a tensor runs past the end of the file.
        raise ModelLoadError(
            path,
            f"corrupted or truncated GGUF file of {size} bytes ({type(e).__name__}: {e})",
        ) from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(
                path,
                f"truncated GGUF: tensor {t.name!r} needs bytes up to {end}, file has {size}",
            )
    return reader


def _metadata(reader: Any, path: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Scalars/strings, and the few arrays we need (tokens, merges, token types)."""
    import gguf

    scalars: dict[str, Any] = {}
    arrays: dict[str, list[Any]] = {}
    wanted_arrays = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}
    for key, field in reader.fields.items():
        try:
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
                if key in wanted_arrays:
                    arrays[key] = list(field.contents())
                continue
            scalars[key] = field.contents()
        except Exception as e:
            raise ModelLoadError(path, f"corrupted metadata field {key!r} ({e})") from e
    return scalars, arrays


def _f32_to_float(v: Any) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.999999747e-06. The shortest decimal
    that round-trips through float32 is the value the converter was given (1e-05), which keeps
    our config equal to the HF config.json it came from."""
    return float(str(np.float32(v)))


def _config_from_metadata(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str
) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise ModelLoadError(path, f"missing metadata key {full!r}")
        return default

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    key_len = get("attention.key_length", required=False)
    head_dim = int(key_len) if key_len is not None else hidden // heads
    emb = shapes.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError(path, "missing tensor 'token_embd.weight'")
    vocab = int(emb[0])  # the model's vocab; the tokenizer's token list may be shorter
    rope_scaling = None
    scaling_type = get("rope.scaling.type", required=False)
    if "rope_freqs.weight" in shapes:
        raise ModelLoadError(
            path,
            "Llama-3.1-style rope scaling (rope_freqs tensor) is not supported from GGUF; "
            "load the Hugging Face folder instead",
        )
    if scaling_type not in (None, "none"):
        factor = get("rope.scaling.factor", required=False)
        if scaling_type != "linear" or factor is None:
            raise ModelLoadError(path, f"unsupported rope scaling {scaling_type!r}")
        rope_scaling = {"rope_type": "linear", "factor": float(factor)}
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_f32_to_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32_to_float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 8192)),
            tie_word_embeddings="output.weight" not in shapes,
            attention_bias="blk.0.attn_q.bias" in shapes,
            arch=arch,
            rope_scaling=rope_scaling,
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid hyper-parameters ({e})") from e


def _tokenizer_spec(meta: dict[str, Any], arrays: dict[str, list[Any]], path: str) -> TokenizerSpec | None:
    tokens = arrays.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    model = meta.get("tokenizer.ggml.model", "gpt2")
    merges = arrays.get("tokenizer.ggml.merges")
    if model == "gpt2" and merges is None:
        raise ModelLoadError(path, "byte-level BPE tokenizer without 'tokenizer.ggml.merges'")

    def opt_int(key: str) -> int | None:
        v = meta.get(key)
        return None if v is None else int(v)

    types = arrays.get("tokenizer.ggml.token_type")
    try:
        return TokenizerSpec(
            tokens=[str(t) for t in tokens],
            merges=[str(m) for m in merges or []],
            token_types=[int(t) for t in types] if types is not None else None,
            bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
            unk_token_id=opt_int("tokenizer.ggml.unknown_token_id"),
            pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
            model=str(model),
            pre=meta.get("tokenizer.ggml.pre"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid tokenizer metadata ({e})") from e


def gguf_name_to_hf(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown)."""
    m = _BLK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{kind}"


def hf_name_to_gguf(name: str) -> str | None:
    m = _HF_LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        g = _HF_LAYER_TO_GGUF.get(part)
        return None if g is None else f"blk.{layer}.{g}.{kind}"
    base, _, kind = name.rpartition(".")
    g = _HF_GLOBAL_TO_GGUF.get(base)
    return None if g is None else f"{g}.{kind}"


def load_gguf(path: str | os.PathLike[str], *, with_weights: bool = True) -> GGUFModel:
    """Read a GGUF: config, float32 state dict in HF layout, tokenizer metadata.

    Raises :class:`ModelLoadError` (naming the file) for a missing/truncated/corrupted file,
    an unsupported architecture or unknown tensors.
    """
    import gguf

    path = os.fspath(path)
    reader = _open_reader(path)
    meta, arrays = _metadata(reader, path)
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}
    config = _config_from_metadata(meta, shapes, path)
    spec = _tokenizer_spec(meta, arrays, path)

    state_dict: dict[str, torch.Tensor] = {}
    if with_weights:
        for t in reader.tensors:
            hf = gguf_name_to_hf(t.name)
            if hf is None:
                raise ModelLoadError(path, f"unexpected tensor {t.name!r} for arch {config.arch!r}")
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ModelLoadError(
                    path, f"tensor {t.name!r}: quantization {t.tensor_type.name} not supported ({e})"
                ) from e
            except Exception as e:
                raise ModelLoadError(path, f"tensor {t.name!r}: cannot decode ({e})") from e
            shape = shapes[t.name]
            if arr.size != int(np.prod(shape)):
                raise ModelLoadError(
                    path, f"tensor {t.name!r}: {arr.size} values for shape {list(shape)}"
                )
            arr = np.asarray(arr, dtype=np.float32).reshape(shape)
            if config.arch == "llama":
                if ".self_attn.q_proj." in hf:
                    arr = unpermute_qk(arr, config.num_heads)
                elif ".self_attn.k_proj." in hf:
                    arr = unpermute_qk(arr, config.num_kv_heads)
            # Copy: the memmap would otherwise stay open and read-only under the tensor.
            state_dict[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    name = meta.get("general.name")
    return GGUFModel(config=config, state_dict=state_dict, tokenizer_spec=spec,
                     name=str(name) if name is not None else None, metadata=meta)
