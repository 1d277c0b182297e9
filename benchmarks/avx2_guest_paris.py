"""The capital-of-France answer of the real SmolLM2 in each ``--dtype`` (float32,
bfloat16, auto), greedy, in one process (an emulated guest pays torch's import and the model load
once), with the paths each engine took; exit status 1 unless every answer names Paris.
Run by ``benchmarks/avx2_guest_job.sh``; runs anywhere."""

from __future__ import annotations

import sys
import time

import radixserve  # noqa: F401  (caps torch's libraries first under RADIXSERVE_CPU_ISA)
import torch

from radixserve import Engine, SamplingParams
from radixserve.model.registry import load_model

QUESTION = "What is the capital of France?"


def main() -> int:
    t0 = time.perf_counter()
    loaded = load_model("smollm2-135m", dtype=torch.float32)
    print(f"model loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    ok = True
    for dtype in ("float32", "bfloat16", "auto"):  # auto last: it measures first
        t0 = time.perf_counter()
        eng = Engine(loaded, dtype=dtype)
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                   add_generation_prompt=True)
        text = eng.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].text
        s = eng.stats()
        print(f"--dtype {dtype} -> {s['dtype']} ({s.get('dtype_reason', '')}); linear {s.get('linear')}, "
              f"attention {s.get('attention_impl')}, cpu_isa {s.get('cpu_isa')}; "
              f"{time.perf_counter() - t0:.0f} s: {text!r}", flush=True)
        ok &= "Paris" in text
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
