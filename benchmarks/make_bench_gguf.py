"""Writes the ~1B benchmark GGUFs: Llama-3.2-1B's shape, seeded random weights (not a test).

    python benchmarks/make_bench_gguf.py --out /work/bench-models            # Q4_0 and Q8_0
    python benchmarks/make_bench_gguf.py --out /work/bench-models --types Q4_0

Shape (Llama-3.2-1B): hidden 2048, 16 layers, 32 query heads and 8 KV heads of 64, MLP 8192,
vocabulary 128256, tied embeddings, RoPE base 500000 (without Llama 3's frequency scaling,
which a GGUF would carry in a rope_freqs tensor the loader refuses). Weights: normal(0, 0.02)
from a seeded generator, quantized by the ``gguf`` package (its numpy quantizers are
bit-exact to llama.cpp's reference ones) to one type for every 2-D tensor, the embedding
included; norms in F32. The tokenizer is SmolLM2's (49152 tokens), its list padded to the
model's vocabulary with unused placeholder tokens (llama.cpp refuses a list shorter than the
embedding), so prompts tokenize as they do for SmolLM2.
Decode and prefill speed do not depend on the weights' values, only on their shapes and
types; the text the model writes is noise.

The files are large (Q4_0 ~0.7 GB, Q8_0 ~1.3 GB) and kept out of the repository; an existing
file is left alone (``--force`` rewrites it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))

SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, inter=8192, vocab=128256,
             rope_theta=500000.0, eps=1e-5, context=8192)


def _tokenizer(w, gguf, vocab: int) -> None:
    """SmolLM2's tokenizer metadata, copied from its GGUF, the list padded to ``vocab``."""
    from radixserve.model.loaders.gguf_loader import read_gguf_header
    from radixserve.model.loaders.packages import ensure_smollm2

    _, meta, arrays, _ = read_gguf_header(ensure_smollm2())
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    tokens = list(arrays["tokenizer.ggml.tokens"])
    pad = vocab - len(tokens)
    w.add_token_list(tokens + [f"<|bench_unused_{i}|>" for i in range(pad)])
    types = list(arrays.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    w.add_token_types(types + [int(gguf.TokenType.UNUSED)] * pad)
    w.add_token_merges(arrays["tokenizer.ggml.merges"])
    for key, adder in (("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                       ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                       ("tokenizer.ggml.padding_token_id", w.add_pad_token_id)):
        if key in meta:
            adder(int(meta[key]))
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])


def write(path: str, qtype: str, seed: int) -> None:
    import gguf

    s = SHAPE
    t = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"bench-llama-1b-{qtype.lower()}")
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_vocab_size(s["vocab"])
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    _tokenizer(w, gguf, s["vocab"])

    def mat(name: str, rows: int, cols: int) -> None:
        a = (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02))
        w.add_tensor(name, gguf.quants.quantize(a, t), raw_shape=gguf.quant_shape_to_byte_shape(a.shape, t),
                     raw_dtype=t)

    h, d = s["hidden"], s["head_dim"]
    mat("token_embd.weight", s["vocab"], h)
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        mat(p + "attn_q.weight", s["heads"] * d, h)
        mat(p + "attn_k.weight", s["kv_heads"] * d, h)
        mat(p + "attn_v.weight", s["kv_heads"] * d, h)
        mat(p + "attn_output.weight", h, s["heads"] * d)
        mat(p + "ffn_gate.weight", s["inter"], h)
        mat(p + "ffn_up.weight", s["inter"], h)
        mat(p + "ffn_down.weight", h, s["inter"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/work/bench-models", help="folder for the files (outside the repository)")
    ap.add_argument("--types", default="Q4_0,Q8_0", help="comma-separated GGUF types (Q4_0, Q4_1, Q8_0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rewrite existing files")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for qtype in args.types.split(","):
        path = os.path.join(args.out, f"bench-llama-1b-{qtype.lower()}.gguf")
        if os.path.exists(path) and not args.force:
            print(f"{path}: exists ({os.path.getsize(path) / 2**20:.0f} MiB)")
            continue
        t0 = time.perf_counter()
        write(path + ".part", qtype, args.seed)
        os.replace(path + ".part", path)
        print(f"{path}: {os.path.getsize(path) / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
