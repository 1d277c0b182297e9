"""How far each greedy answer is from a knife edge, per model and dtype (not a test).

    python benchmarks/answer_margins.py [--models smollm2-135m,gemma3-270m] [--tokens 16]

For the capital of France (SmolLM2-Instruct asked "What is the capital of France?" as a user
turn; Gemma 3 270M, a base model, completing "The capital of France is": what
``radixserve generate`` sends each) it prints the greedy answer in each dtype and
linear backend (and on the GGUF's quantized blocks), and the top-2 margin of every generated
token: the logit of the chosen token minus the runner-up's (the difference of their logprobs:
log-softmax shifts both alike). A margin near 0 means a rounding anywhere upstream could flip
that token; the smallest margin over the answer is the answer's distance from a knife edge.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve import SamplingParams  # noqa: E402
from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402

QUESTIONS = {"smollm2-135m": "What is the capital of France?", "gemma3-270m": "The capital of France is"}
# (dtype, linear backend, weights): the bfloat16 model dense and on the GGUF's blocks (the same
# bits by construction: the two rows must agree to the last digit), and on the block codes (its
# own definition: near the dense model, not its bits).
SETTINGS = [("float32", "auto", "dense"), ("bfloat16", "auto", "dense"), ("bfloat16", "auto", "gguf"),
            ("bfloat16", "auto", "gguf-codes"), ("bfloat16", "radixserve-f32", "dense")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    print(f"CPU: {describe()}\n")
    print("| model | dtype | linear | weights | answer | min top-2 margin (at token) | margin per token |")
    print("|---|---|---|---|---|---:|---|")
    for name in args.models.split(","):
        for dtype, backend, weights in SETTINGS:
            loaded = load_model(name, dtype=getattr(torch, dtype), weights=weights)
            eng = Engine(loaded, dtype=dtype, linear_backend=backend, kv_cache_tokens=1024)
            tok = eng.tokenizer
            chat = not tok.chat_template_builtin  # as radixserve generate decides
            question = QUESTIONS.get(name, QUESTIONS["gemma3-270m"])
            prompt = tok.apply_chat_template([{"role": "user", "content": question}]) if chat else question
            ids = tok.encode(prompt) if chat else eng.encode(prompt)
            out = eng.generate([ids], SamplingParams(max_tokens=args.tokens, temperature=0, logprobs=True,
                                                     top_logprobs=2, ignore_eos=False))[0]
            margins = [top[0][1] - top[1][1] for top in out.top_logprobs if len(top) > 1]
            at = min(range(len(margins)), key=margins.__getitem__)
            answer = out.text.replace("\n", " ").replace("|", "/")
            held = "+".join(eng.core.runner.model.weight_formats()) or "dense"
            print(f"| {name} | {dtype} | {eng.core.runner.model.linears.backend} | {held} | {answer!r} | "
                  f"{margins[at]:.3f} ({at}) | {' '.join(f'{m:.2f}' for m in margins)} |", flush=True)
            eng.close()


if __name__ == "__main__":
    main()
