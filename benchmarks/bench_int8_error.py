"""Per-output-channel int8 weights (``--weight-dtype int8``): the error they cost against the
float32 model, measured as ``bench_kv_quant.py error`` measures the quantized KV (not a test:
prints numbers).

    python benchmarks/bench_int8_error.py --prompts 200
    python benchmarks/bench_int8_error.py --model /path/to/hf-folder --prompts 100

Rows (the same file; weights as each row holds them, KV in the model's dtype):

* ``float32``: the reference — float32 weights (a GGUF's dequantized values), float32 KV;
* ``bfloat16``: the dense bfloat16 model (the default on a CPU with bfloat16 kernels);
* ``bfloat16, gguf blocks``: a GGUF's blocks computed directly (only for a GGUF): the same bits
  as ``bfloat16`` by construction, so its columns equal that row's;
* ``bfloat16, gguf-q8 (integer dot)``: the same blocks computed with integer dot products against
  activation rows quantized to 8 bits per 32-block (``--weight-dtype gguf-q8``; Q8_0, Q4_0, Q4_1
  tensors, the lm_head included; other formats as the row above);
* ``bfloat16, gguf-codes (block codes)``: the same blocks computed on their integer codes against
  the bfloat16 activations, the scale applied once per block (``--weight-dtype gguf-codes``;
  Q8_0, Q4_0, Q4_1 tensors, the lm_head included; other formats as the ``gguf blocks`` row);
* ``bfloat16, int8``: the decoder's linear weights as per-output-channel int8 (``q = round(w / s)``,
  ``s = max |w[n]| / 127``, from the float32 values), computed on the same kernels.

Over the first human turns of ShareGPT (chat template, at most 384 tokens), the float32 greedy
continuation of each prompt is fed back (teacher forcing) and at each of its positions the greedy
token's log-probability is compared — mean and max |Δ logprob|, top-1 agreement — and perplexity on
ShareGPT assistant text (windows of 1024 tokens from conversations the prompts do not use); then
the greedy answer to "What is the capital of France?".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, _HERE)

from bench_kv_quant import _logprobs, _nll  # noqa: E402
from radixserve import SamplingParams  # noqa: E402
from radixserve.bench.cli import _machine  # noqa: E402
from radixserve.bench.data import load_conversations  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.model.registry import is_gguf_source, load_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--continuation", type=int, default=32)
    ap.add_argument("--ppl-windows", type=int, default=8)
    args = ap.parse_args(argv)
    ref = load_model(args.model, dtype=torch.float32)
    tok = ref.tokenizer
    convs = load_conversations(args.prompts + 64)
    prompts = []
    for c in convs[: args.prompts]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": c.human[0]}]))
        prompts.append(ids[-args.max_prompt:])
    eng = Engine(ref, cache="none", dtype="float32", kv_cache_tokens=32768)
    cont = [o.token_ids for o in eng.generate(
        prompts, SamplingParams(max_tokens=args.continuation, temperature=0, ignore_eos=True))]
    del eng
    seqs = [p + c[:-1] for p, c in zip(prompts, cont)]
    lo = [len(p) - 1 for p in prompts]
    text = " ".join(t for c in convs[args.prompts:] for t in c.gpt)
    ids = tok.encode(text)
    windows = [ids[i * 1024: (i + 1) * 1024] for i in range(min(args.ppl_windows, len(ids) // 1024))]
    cap = max(len(s) for s in seqs) * 8 + 2048
    rows = [("float32", torch.float32, "dense"), ("bfloat16", torch.bfloat16, "dense")]
    if is_gguf_source(args.model):
        rows.append(("bfloat16, gguf blocks", torch.bfloat16, "gguf"))
        rows.append(("bfloat16, gguf-q8 (integer dot)", torch.bfloat16, "gguf-q8"))
        rows.append(("bfloat16, gguf-codes (block codes)", torch.bfloat16, "gguf-codes"))
    rows.append(("bfloat16, int8", torch.bfloat16, "int8"))
    print(f"`python benchmarks/bench_int8_error.py {' '.join(sys.argv[1:])}` — {time.strftime('%Y-%m-%dT%H:%M:%S')}"
          f" — {_machine()} — {args.model}; {len(prompts)} ShareGPT prompts x {args.continuation} greedy "
          f"positions (float32's); perplexity over {len(windows)} x 1024 tokens\n")
    print("| weights | linear weight bytes | mean \\|Δ logprob\\| | max \\|Δ logprob\\| | top-1 agreement | "
          "perplexity | capital of France |")
    print("|---|---:|---:|---:|---:|---:|---|")
    ref_lp = None
    for label, dtype, weights in rows:
        loaded = ref if weights == "dense" and dtype == torch.float32 else load_model(args.model, dtype=dtype,
                                                                                      weights=weights)
        runner = ModelRunner.from_config(loaded.config, loaded.state_dict, kv_capacity=cap, dtype=dtype)
        m = runner.model
        nbytes = sum(getattr(l, n).data.nbytes for l in m.layers
                     for n in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"))
        lps = _logprobs(runner, seqs, lo)
        if ref_lp is None:
            ref_lp = lps
        deltas, agree, n = [], 0, 0
        for aa, ra in zip(lps, ref_lp):
            greedy = ra.argmax(-1)
            deltas.append((aa.gather(1, greedy[:, None]) - ra.gather(1, greedy[:, None])).abs().reshape(-1))
            agree += int((aa.argmax(-1) == greedy).sum())
            n += greedy.numel()
        d = torch.cat(deltas)
        ppl = math.exp(float(_nll(runner, windows).mean()))
        e = Engine(loaded, dtype=str(dtype).removeprefix("torch."), kv_cache_tokens=4096)
        q = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        ans = e.generate([q], SamplingParams(max_tokens=12, temperature=0))[0].text.strip().replace("\n", " ")
        print(f"| {label} | {nbytes / 2**20:.1f} MiB | {float(d.mean()):.5f} | {float(d.max()):.4f} | "
              f"{100 * agree / n:.2f}% | {ppl:.4f} | {ans} |", flush=True)
        del runner, e, loaded


if __name__ == "__main__":
    main()
