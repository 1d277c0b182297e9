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

import math
import os
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.errors import ModelLoadError
from radixserve.model.tokenizer import GEMMA3_CHAT_TEMPLATE, TokenizerSpec

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
GGUF_MAGIC = b"GGUF"

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


# GGUF metadata value types (gguf.GGUFValueType) -> struct format, for scalars and arrays.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# Arrays we keep (the tokenizer); the rest are skipped over.
_WANTED_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                            "tokenizer.ggml.token_type", "tokenizer.ggml.scores"})


class _Truncated(Exception):
    pass


@dataclass
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # absolute, in the file
    n_bytes: int
    data: Any = None  # np.ndarray (uint8 rows) once the file is known to hold it


@dataclass
class _GGUFFile:
    fields: dict[str, Any]  # scalars and strings
    arrays: dict[str, list[Any]]  # the _WANTED_ARRAYS present
    tensors: list[_TensorInfo]


class _Cursor:
    """Sequential little-endian reads over the mapped file; running past its end raises
    _Truncated."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated(f"needs {size} bytes at offset {self.pos}")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(f"needs {n} bytes at offset {self.pos}")
        self.pos += n

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n)
        return str(self.buf[start:self.pos], "utf-8")

    def strings(self, count: int) -> list[str]:
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack_from, append = struct.unpack_from, out.append
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated(f"string array runs past the end at offset {pos}")
            (n,) = unpack_from("<Q", buf, pos)
            pos += 8
            if pos + n > end:
                raise _Truncated(f"string array runs past the end at offset {pos}")
            append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown value type {vtype}")
        itype, count = self.unpack("<I"), self.unpack("<Q")
        if itype == _STRING:
            if keep:
                return self.strings(count)
            for _ in range(count):
                self.skip(self.unpack("<Q"))
            return None
        if itype in _NUMPY_TYPES:
            dt = np.dtype(_NUMPY_TYPES[itype])
            start = self.pos
            self.skip(count * dt.itemsize)
            if not keep:
                return None
            arr = np.frombuffer(self.buf[start:self.pos], dtype=dt)
            return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
        items = [self.value(itype, keep) for _ in range(count)]
        return items if keep else None


def _open_reader(path: str) -> _GGUFFile:
    """Parse a GGUF's header, metadata and tensor table (tensor data stays memory-mapped),
    turning every way a file can be bad into a :class:`ModelLoadError` that names the file
    and says what is wrong.

    Our own parser rather than ``gguf.GGUFReader``: that one builds numpy views for every
    element of every array, which for Gemma 3's 262144-token vocabulary (tokens, scores,
    types) takes ~20 s per open; this reads the same in well under a second.
    """
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
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))
    key = None
    try:
        cur.skip(4)
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        fields: dict[str, Any] = {}
        arrays: dict[str, list[Any]] = {}
        for _ in range(n_kv):
            key = None  # an error reading the name is not the previous field's
            key = cur.string()
            vtype = cur.unpack("<I")
            v = cur.value(vtype, keep=vtype != _ARRAY or key in _WANTED_ARRAYS)
            if vtype == _ARRAY:
                if v is not None:
                    arrays[key] = v
            else:
                fields[key] = v
        key = None
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
            ttype = cur.unpack("<I")
            offset = cur.unpack("<Q")
            infos.append((name, shape, ttype, offset))
    except _Truncated as e:
        where = f" in metadata field {key!r}" if key else ""
        raise ModelLoadError(path, f"corrupted or truncated GGUF file of {size} bytes{where} ({e})") from e
    except ModelLoadError:
        raise
    except (UnicodeDecodeError, ValueError, struct.error, RecursionError) as e:
        what = f"corrupted metadata field {key!r}" if key else "corrupted GGUF header"
        raise ModelLoadError(path, f"{what} ({type(e).__name__}: {e})") from e
    alignment = fields.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ModelLoadError(path, f"invalid general.alignment {alignment!r}")
    start = cur.pos + (-cur.pos) % alignment
    tensors = []
    for name, shape, ttype, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(path, f"tensor {name!r}: unknown tensor type {ttype}") from e
        n_elems = math.prod(shape)
        row = shape[0] if shape else 1
        if row % block:
            raise ModelLoadError(
                path, f"tensor {name!r}: row of {row} values is not whole {qtype.name} blocks"
            )
        n_bytes = n_elems // block * type_size
        begin = start + offset
        end = begin + n_bytes
        if end > size:
            raise ModelLoadError(
                path, f"truncated GGUF: tensor {name!r} needs bytes up to {end}, file has {size}"
            )
        info = _TensorInfo(name, shape, qtype, begin, n_bytes)
        # Rows of raw bytes, as gguf.quants.dequantize expects them (it reads the row length
        # from the last axis; F32/F16 are reinterpreted in place).
        info.data = data[begin:end].reshape(-1, row // block * type_size) if n_bytes else data[begin:end]
        tensors.append(info)
    return _GGUFFile(fields=fields, arrays=arrays, tensors=tensors)


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
    value_len = get("attention.value_length", required=False)
    if value_len is not None and int(value_len) != head_dim:
        raise ModelLoadError(
            path, f"attention.value_length {int(value_len)} != key_length {head_dim} is not supported"
        )
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
    num_layers = int(get("block_count"))
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
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
    if arch == "gemma3":
        # Gemma 2's soft-capping; Gemma 3 files leave it out (llama.cpp: absent or 0 = off).
        cap = get("attn_logit_softcapping", required=False)
        if cap is not None and float(cap) != 0.0:
            raise ModelLoadError(path, f"gemma3 attn_logit_softcapping {float(cap)} is not supported")
        final_cap = get("final_logit_softcapping", required=False)
        # 0 or absent: no sliding window, every layer global (llama.cpp: LLAMA_SWA_TYPE_NONE).
        window = int(get("attention.sliding_window", 0, required=False))
        if window > 0:
            layer_types = tuple(
                "full" if i % GEMMA3_SWA_PATTERN == GEMMA3_SWA_PATTERN - 1 else "sliding"
                for i in range(num_layers)
            )
        else:
            layer_types = ("full",) * num_layers
        # gemma_pytorch's config: 27B (62 layers) scales by hidden/heads, the rest by head_dim.
        scalar = hidden // heads if num_layers == 62 else head_dim
        kwargs.update(
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=GEMMA3_ROPE_LOCAL_THETA,
            query_pre_attn_scalar=float(scalar),
            hidden_act="gelu_pytorch_tanh",
            final_logit_softcapping=float(final_cap) if final_cap else None,
        )
    return kwargs


def _config_from_kwargs(kwargs: dict[str, Any], path: str) -> ModelConfig:
    try:
        return ModelConfig(**kwargs)
    except TypeError as e:  # a ModelConfig without the fields this architecture needs
        raise ModelLoadError(
            path, f"architecture {kwargs['arch']!r} is not supported by this ModelConfig ({e})"
        ) from e
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
    if template is None and arch == "gemma3":
        # gguf-my-repo conversions of google/gemma-3-* often carry no template: use Gemma 3's.
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
            add_bos_token=bool(add_bos),
            scores=[float(x) for x in scores] if scores is not None else None,
            # Only a SentencePiece vocabulary is assembled per architecture.
            arch=str(arch) if model == "llama" and arch is not None else None,
        )
    except ValueError as e:
        raise ModelLoadError(path, f"invalid tokenizer metadata ({e})") from e


def _layer_names(arch: str) -> dict[str, str]:
    return _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)


@lru_cache(maxsize=None)
def _hf_to_gguf_layer_names(arch: str) -> dict[str, str]:
    return {v: k for k, v in _layer_names(arch).items()}


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


def hf_name_to_gguf(name: str, arch: str = "llama") -> str | None:
    m = _HF_LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        g = _hf_to_gguf_layer_names(arch).get(part)
        return None if g is None else f"blk.{layer}.{g}.{kind}"
    base, _, kind = name.rpartition(".")
    g = _HF_GLOBAL_TO_GGUF.get(base)
    return None if g is None else f"{g}.{kind}"


def read_gguf_header(
    path: str | os.PathLike[str],
) -> tuple[Any, dict[str, Any], dict[str, list[Any]], dict[str, tuple[int, ...]]]:
    """``(file, metadata, tokenizer arrays, shapes)`` of a GGUF without decoding weights:
    ``file.tensors`` hold each tensor's memory-mapped raw bytes (``.data``), metadata the
    scalars/strings, shapes the torch-order shape of every tensor."""
    path = os.fspath(path)
    reader = _open_reader(path)
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


def _state_dict(reader: _GGUFFile, kwargs: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    import gguf

    arch = kwargs["arch"]
    state_dict: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = gguf_name_to_hf(t.name, arch)
        if hf is None:
            raise ModelLoadError(path, f"unexpected tensor {t.name!r} for arch {arch!r}")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                path, f"tensor {t.name!r}: quantization {t.tensor_type.name} not supported ({e})"
            ) from e
        except Exception as e:
            raise ModelLoadError(path, f"tensor {t.name!r}: cannot decode ({e})") from e
        shape = tuple(reversed(t.shape))
        if arr.size != int(np.prod(shape)):
            raise ModelLoadError(path, f"tensor {t.name!r}: {arr.size} values for shape {list(shape)}")
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if arch == "llama":
            if ".self_attn.q_proj." in hf:
                arr = unpermute_qk(arr, kwargs["num_heads"])
            elif ".self_attn.k_proj." in hf:
                arr = unpermute_qk(arr, kwargs["num_kv_heads"])
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # the converter stored 1 + w
        # Copy: the memmap would otherwise stay open and read-only under the tensor.
        state_dict[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    return state_dict


def load_gguf_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Only the float32 state dict of a GGUF, in HF names and layout (no ModelConfig built)."""
    path = os.fspath(path)
    reader, meta, _, shapes = read_gguf_header(path)
    return _state_dict(reader, config_kwargs_from_metadata(meta, shapes, path), path)


def load_gguf(path: str | os.PathLike[str], *, with_weights: bool = True) -> GGUFModel:
    """Read a GGUF: config, float32 state dict in HF layout, tokenizer metadata.

    Raises :class:`ModelLoadError` (naming the file) for a missing/truncated/corrupted file,
    an unsupported architecture or unknown tensors.
    """
    path = os.fspath(path)
    reader, meta, arrays, shapes = read_gguf_header(path)
    kwargs = config_kwargs_from_metadata(meta, shapes, path)
    config = _config_from_kwargs(kwargs, path)
    spec = _tokenizer_spec(meta, arrays, path)
    state_dict = _state_dict(reader, kwargs, path) if with_weights else {}
    name = meta.get("general.name")
    return GGUFModel(config=config, state_dict=state_dict, tokenizer_spec=spec,
                     name=str(name) if name is not None else None, metadata=meta)
