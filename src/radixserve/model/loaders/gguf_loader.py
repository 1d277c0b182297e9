"""Read GGUF files of the llama, qwen2 and gemma3 architectures.

A GGUF holds three things we need: the hyper-parameters (``{arch}.*`` metadata), the weights
(possibly quantized; we dequantize to float32 with the ``gguf`` package, since our model runs
dense matmuls) and the tokenizer (``tokenizer.ggml.*`` + ``tokenizer.chat_template``).

Two conversions undo what llama.cpp's ``convert_hf_to_gguf.py`` did, so the result is a state
dict in Hugging Face naming and layout, interchangeable with one from safetensors:

* tensor names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` etc.
* q/k row order: for the llama arch the converter permutes the rows of q_proj/k_proj from HF's
  rotate-half RoPE layout to GGML's interleaved-pairs layout. Our attention (like HF) rotates
  halves, so we permute back; without it the very first generated token is already wrong.
  qwen2 and gemma3 files are not permuted (llama.cpp runs them with NEOX, i.e. rotate-half,
  RoPE; its converter permutes only in ``LlamaModel``).
* gemma3 norms: Gemma's RMSNorm scales by ``1 + w`` and the converter stores ``w + 1`` so that
  llama.cpp can multiply by the stored value. Our model (like HF) applies ``1 + w`` itself, so
  every ``*norm.weight`` (layer norms, q/k norms, the final norm) gets 1 subtracted again.

gemma3 hyper-parameters that the file does not state are derived as llama.cpp derives them
(``llama_model::load_hparams``, ``LLM_ARCH_GEMMA3``): every 6th layer is global
(``set_swa_pattern(6)``: layer ``i`` slides unless ``i % 6 == 5``), sliding layers use RoPE base
10000, and queries are scaled by ``1/sqrt(head_dim)`` (by ``1/sqrt(hidden/heads)`` for the
62-layer 27B), i.e. HF's ``query_pre_attn_scalar``.

GGUF stores a tensor's shape fastest-dimension first (``[in, out]``); numpy/torch list it
slowest first (``[out, in]``), so the numpy shape is the reversed GGUF shape.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.kernels.quant_weights import QuantTensor
from radixserve.model.model_config import ModelConfig
from radixserve.model.load_error import ModelLoadError
from radixserve.model.loaders.gguf_file import GGUFFile, open_gguf
from radixserve.model.tokenization.tokenizer import GEMMA3_CHAT_TEMPLATE, TokenizerSpec

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")

log = logging.getLogger(__name__)

# llama.cpp's fixed gemma3 constants (see the module docstring).
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_LOCAL_THETA = 10000.0

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
# Gemma 2/3 have four norms per layer; llama.cpp's "ffn_norm" is the pre-FFN one there.
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass
class GGUFModel:
    """What a GGUF file describes, in our terms."""

    config: ModelConfig
    # float32, HF names and layout (QuantTensor values: linear weights kept in their blocks)
    state_dict: dict[str, Any]
    tokenizer_spec: TokenizerSpec | None
    name: str | None  # general.name
    metadata: dict[str, Any]  # every scalar/string metadata value (arrays left out)


# ---- q/k permutation ------------------------------------------------------------------------


def unpermute_qk(w: np.ndarray | torch.Tensor, n_head: int) -> Any:
    """llama.cpp's interleaved q/k row order (its converter permutes them) -> HF rotate-half order."""
    d = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, d // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(d, *rest)


def _f32_to_float(v: Any) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.999999747e-06. The shortest decimal
    that round-trips through float32 is the value the converter was given (1e-05), which keeps
    our config equal to the HF config.json it came from."""
    return float(str(np.float32(v)))


def config_kwargs_from_metadata(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str
) -> dict[str, Any]:
    """The :class:`ModelConfig` keyword arguments a GGUF's metadata and tensor shapes imply."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    m = _ArchMetadata(meta, arch, path)
    hidden = int(m.get("embedding_length"))
    heads = int(m.get("attention.head_count"))
    key_len = m.get("attention.key_length", required=False)
    head_dim = int(key_len) if key_len is not None else hidden // heads
    value_len = m.get("attention.value_length", required=False)
    if value_len is not None and int(value_len) != head_dim:
        raise ModelLoadError(path, f"attention.value_length {int(value_len)} != key_length {head_dim} is not supported")
    emb = shapes.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError(path, "missing tensor 'token_embd.weight'")
    kwargs: dict[str, Any] = dict(
        vocab_size=int(emb[0]),  # the model's vocab; the tokenizer's token list may be shorter
        hidden_size=hidden,
        intermediate_size=int(m.get("feed_forward_length")),
        num_layers=int(m.get("block_count")),
        num_heads=heads,
        num_kv_heads=int(m.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32_to_float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32_to_float(m.get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(m.get("context_length", 8192)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        arch=arch,
        rope_scaling=m.rope_scaling(shapes),
    )
    if arch == "gemma3":
        kwargs.update(m.gemma3_kwargs(kwargs["num_layers"], hidden // heads, head_dim))
    return kwargs


class _ArchMetadata:
    """A GGUF's ``{arch}.*`` metadata, read by key with a ModelLoadError naming a missing one."""

    def __init__(self, meta: dict[str, Any], arch: str, path: str):
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if required and default is None:
            raise ModelLoadError(self.path, f"missing metadata key {full!r}")
        return default

    def rope_scaling(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any] | None:
        """``ModelConfig.rope_scaling``: None or linear; ModelLoadError for any other kind."""
        if "rope_freqs.weight" in shapes:
            raise ModelLoadError(self.path, "Llama-3.1-style rope scaling (rope_freqs tensor) is not supported from "
                                            "GGUF; load the Hugging Face folder instead")
        scaling_type = self.get("rope.scaling.type", required=False)
        if scaling_type in (None, "none"):
            return None
        factor = self.get("rope.scaling.factor", required=False)
        if scaling_type != "linear" or factor is None:
            raise ModelLoadError(self.path, f"unsupported rope scaling {scaling_type!r}")
        return {"rope_type": "linear", "factor": float(factor)}

    def gemma3_kwargs(self, num_layers: int, hidden_per_head: int, head_dim: int) -> dict[str, Any]:
        """Gemma 3's own config fields: sliding window and layer kinds, local RoPE, q scale."""
        # Gemma 2's soft-capping; Gemma 3 files leave it out (llama.cpp: absent or 0 = off).
        cap = self.get("attn_logit_softcapping", required=False)
        if cap is not None and float(cap) != 0.0:
            raise ModelLoadError(self.path, f"gemma3 attn_logit_softcapping {float(cap)} is not supported")
        final_cap = self.get("final_logit_softcapping", required=False)
        # 0 or absent: no sliding window, every layer global (llama.cpp: LLAMA_SWA_TYPE_NONE).
        window = int(self.get("attention.sliding_window", 0, required=False))
        layer_types = tuple("full" if window <= 0 or i % GEMMA3_SWA_PATTERN == GEMMA3_SWA_PATTERN - 1 else "sliding"
                            for i in range(num_layers))
        # gemma_pytorch's config: 27B (62 layers) scales by hidden/heads, the rest by head_dim.
        scalar = hidden_per_head if num_layers == 62 else head_dim
        return dict(
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=GEMMA3_ROPE_LOCAL_THETA,
            query_pre_attn_scalar=float(scalar),
            hidden_act="gelu_pytorch_tanh",
            final_logit_softcapping=float(final_cap) if final_cap else None,
        )


def _config_from_kwargs(kwargs: dict[str, Any], path: str) -> ModelConfig:
    try:
        return ModelConfig(**kwargs)
    except TypeError as e:  # a ModelConfig without the fields this architecture needs
        raise ModelLoadError(path, f"architecture {kwargs['arch']!r} is not supported by this ModelConfig ({e})") from e
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
    arch = meta.get("general.architecture")

    def opt_int(key: str) -> int | None:
        v = meta.get(key)
        return None if v is None else int(v)

    types = arrays.get("tokenizer.ggml.token_type")
    scores = arrays.get("tokenizer.ggml.scores")
    template = meta.get("tokenizer.chat_template")
    builtin = template is None and arch == "gemma3"
    if builtin:
        # gguf-my-repo conversions of google/gemma-3-* often carry no template (the base
        # model's never does): chat requests get Gemma 3's, marked as not the model's own.
        template = GEMMA3_CHAT_TEMPLATE
    # llama.cpp (and transformers) add BOS for a sentencepiece vocabulary that does not say.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
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
            chat_template=template,
            chat_template_builtin=builtin,
            add_bos_token=bool(add_bos),
            scores=[float(x) for x in scores] if scores is not None else None,
            # Only a SentencePiece vocabulary is assembled per architecture.
            arch=str(arch) if model == "llama" and arch is not None else None,
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid tokenizer metadata ({e})") from e


def _layer_names(arch: str) -> dict[str, str]:
    return _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)


def gguf_name_to_hf(name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None if unknown
    for ``arch``; gemma3 names its norms differently)."""
    m = _BLK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = _layer_names(arch).get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{kind}"


def read_gguf_header(
    path: str | os.PathLike[str],
) -> tuple[Any, dict[str, Any], dict[str, list[Any]], dict[str, tuple[int, ...]]]:
    """``(file, metadata, tokenizer arrays, shapes)`` of a GGUF without decoding weights:
    ``file.tensors`` hold each tensor's memory-mapped raw bytes (``.data``), metadata the
    scalars/strings, shapes the torch-order shape of every tensor."""
    path = os.fspath(path)
    reader = open_gguf(path)
    meta, arrays = reader.fields, reader.arrays
    shapes = {t.name: tuple(reversed(t.shape)) for t in reader.tensors}
    return reader, meta, arrays, shapes


def gguf_config_kwargs(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The :class:`ModelConfig` keyword arguments of a GGUF, without building the config or
    reading weights (what :func:`load_gguf` passes to ``ModelConfig``)."""
    path = os.fspath(path)
    _, meta, _, shapes = read_gguf_header(path)
    return config_kwargs_from_metadata(meta, shapes, path)


def load_gguf_tokenizer_spec(path: str | os.PathLike[str]) -> TokenizerSpec | None:
    """Only the tokenizer metadata of a GGUF (no config, no weights): what an API process
    that tokenizes for an engine elsewhere needs."""
    path = os.fspath(path)
    _, meta, arrays, shapes = read_gguf_header(path)
    if meta.get("general.architecture") not in SUPPORTED_ARCHS:
        config_kwargs_from_metadata(meta, shapes, path)  # raises the unsupported-arch error
    return _tokenizer_spec(meta, arrays, path)


def _is_linear(hf: str) -> bool:
    """Whether an HF tensor name is a linear weight (a projection, the embedding table that is
    also the tied lm_head, the lm_head): what may stay in its quantized blocks."""
    return hf.endswith(".weight") and (hf.startswith("model.embed_tokens.") or hf.startswith("lm_head.") or
                                       any(f".{p}." in hf for p in _LINEAR_PARTS))


_LINEAR_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _state_dict(reader: GGUFFile, kwargs: dict[str, Any], path: str,
                keep: frozenset[str] = frozenset(), dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    import gguf

    arch = kwargs["arch"]
    state_dict: dict[str, Any] = {}
    dequantized: dict[str, int] = {}
    # The llama arch's permuted q/k rows (see the module docstring), by head count.
    qk_heads = {".self_attn.q_proj.": kwargs["num_heads"], ".self_attn.k_proj.": kwargs["num_kv_heads"]}
    for t in reader.tensors:
        hf = gguf_name_to_hf(t.name, arch)
        if hf is None:
            raise ModelLoadError(path, f"unexpected tensor {t.name!r} for arch {arch!r}")
        n_head = next((n for part, n in qk_heads.items() if part in hf), None) if arch == "llama" else None
        qtype = t.tensor_type.name
        shape = tuple(reversed(t.shape))
        if qtype in keep and _is_linear(hf) and len(t.shape) == 2:
            qt = QuantTensor.from_gguf(qtype, t.data, shape)
            state_dict[hf] = qt if n_head is None else qt.permute_rows(unpermute_qk(np.arange(shape[0]), n_head))
            continue
        if qtype != "F32":
            dequantized[qtype] = dequantized.get(qtype, 0) + 1
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(path, f"tensor {t.name!r}: quantization {qtype} not supported ({e})") from e
        except Exception as e:
            raise ModelLoadError(path, f"tensor {t.name!r}: cannot decode ({e})") from e
        if arr.size != int(np.prod(shape)):
            raise ModelLoadError(path, f"tensor {t.name!r}: {arr.size} values for shape {list(shape)}")
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if n_head is not None:
            arr = unpermute_qk(arr, n_head)
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # the converter stored 1 + w
        # Copy: the memmap would otherwise stay open and read-only under the tensor. Cast
        # tensor by tensor, so that a bfloat16 load never holds the whole float32
        # dequantization (twice the bfloat16 model) at once.
        state_dict[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).to(dtype)
    if dequantized:
        kept = sorted({q.formats[0] for q in state_dict.values() if isinstance(q, QuantTensor)})
        log.info("%s: dequantized at load: %s%s", os.path.basename(path),
                 ", ".join(f"{k} ({n} tensors)" for k, n in sorted(dequantized.items())),
                 f"; kept in blocks: {', '.join(kept)}" if kept else "")
    return state_dict


def load_gguf_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Only the float32 state dict of a GGUF, in HF names and layout (no ModelConfig built)."""
    path = os.fspath(path)
    reader, meta, _, shapes = read_gguf_header(path)
    return _state_dict(reader, config_kwargs_from_metadata(meta, shapes, path), path)


def load_gguf(path: str | os.PathLike[str], *, with_weights: bool = True,
              keep_quantized: frozenset[str] = frozenset(), dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read a GGUF: config, state dict in HF layout (dense tensors dequantized to float32 and
    cast to ``dtype``), tokenizer metadata.

    ``keep_quantized``: GGUF types (``kernels.quant_weights.GGUF_FORMATS``) whose linear weights stay
    in their blocks, as :class:`~radixserve.kernels.quant_weights.QuantTensor` values of the state
    dict (q/k rows un-permuted like the dense ones); every other type is dequantized, and a
    log line names them.

    Raises :class:`ModelLoadError` (naming the file) for a missing/truncated/corrupted file,
    an unsupported architecture or unknown tensors.
    """
    path = os.fspath(path)
    reader, meta, arrays, shapes = read_gguf_header(path)
    kwargs = config_kwargs_from_metadata(meta, shapes, path)
    config = _config_from_kwargs(kwargs, path)
    spec = _tokenizer_spec(meta, arrays, path)
    state_dict = _state_dict(reader, kwargs, path, keep_quantized, dtype) if with_weights else {}
    name = meta.get("general.name")
    return GGUFModel(config=config, state_dict=state_dict, tokenizer_spec=spec,
                     name=str(name) if name is not None else None, metadata=meta)
