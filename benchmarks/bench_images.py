"""Images keyed by content vs images that are never shared: 8 images x 6 questions, shuffled.

A random LLaVA sized like a small real VLM is written to a temporary folder (the layout of
``tiny-random-llava``, other sizes): the decoder has SmolLM2-135M's shape (30 layers, hidden
576, 9 heads / 3 KV heads, MLP 1536; the vocabulary stays the tiny tokenizer's 520 tokens),
the tower is a CLIP ViT-B/16 at 224 px (12 layers, hidden 768, MLP 3072; 196 image tokens,
read at layer -2). Every request is ``<image>`` then a question, in the chat template; the
48 requests go in shuffled, all at once, ``--max-tokens`` greedy tokens each.

Modes, each in a fresh engine, run alternately ``--repeats`` times:

* ``content``: image tokens keyed by the image's hash (the default), encoder LRU on;
* ``unshared``: every request's image tokens are its own (``image_content_keys=False``) and
  the encoder LRU is off: what a cache keyed by token ids alone can do with images.

Printed per mode: req/s, prompt-token hit rate, image-token hit rate, images encoded and
seconds in the encoder; then the ratios. Run: ``python benchmarks/bench_images.py``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from PIL import Image

from radixserve import SamplingParams
from radixserve.kernels.isa import describe
from radixserve.engine.engine import Engine
from radixserve.model.testing.tiny_llava import tiny_llava_text_config, tiny_llava_vision_config, write_tiny_llava

QUESTIONS = ["What is in the picture?", "Which colour dominates?", "How many objects are there?",
             "Describe the background.", "Is it day or night?", "What would you title it?"]


def write_model(path: str) -> None:
    text = tiny_llava_text_config(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                                  num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    vision = tiny_llava_vision_config(hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
                                      image_size=224, patch_size=16)
    write_tiny_llava(path, seed=0, text=text, vision=vision)


def images(n: int) -> list[Image.Image]:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        arr = torch.randint(0, 256, (240, 320, 3), generator=g, dtype=torch.uint8).numpy()
        out.append(Image.fromarray(arr, mode="RGB"))
    return out


def run(path: str, mode: str, work: list[tuple[str, Image.Image]], max_tokens: int, kv_tokens: int) -> dict:
    kw = dict(image_content_keys=False, image_cache_bytes=0) if mode == "unshared" else {}
    eng = Engine(path, dtype="float32", kv_cache_tokens=kv_tokens, **kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate([p for p, _ in work], params, images=[[im] for _, im in work])
    wall = time.perf_counter() - t0
    s = eng.stats()
    return {"req_s": len(outs) / wall, "wall": wall, "hit": s["prefix_cache_hit_rate"],
            "image_hit": s["cached_image_tokens"] / max(1, s["image_query_tokens"]),
            "encoded": int(s["images_encoded"]), "encoder_s": s["image_encoder_seconds"],
            "outputs": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"CPU: {describe()}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        write_model(tmp)
        eng = Engine(tmp, dtype="float32", kv_cache_tokens=1024)
        tmpl = eng.tokenizer.apply_chat_template
        imgs = images(a.images)
        work = [(tmpl([{"role": "user", "content": f"<image>\n{q}"}], add_generation_prompt=True), im)
                for im in imgs for q in QUESTIONS[: a.questions]]
        random.Random(a.seed).shuffle(work)
        vc = eng.core.loaded.vision.config
        print(f"model: decoder 30 layers hidden 576 (SmolLM2-135M shape), CLIP ViT-B/16 224 px, "
              f"{vc.tokens_per_image} tokens per image; {len(work)} requests "
              f"({a.images} images x {a.questions} questions), {a.max_tokens} tokens out")
        del eng
        results: dict[str, list[dict]] = {"content": [], "unshared": []}
        for r in range(a.repeats):
            for mode in ("content", "unshared"):
                res = run(tmp, mode, work, a.max_tokens, a.kv_tokens)
                results[mode].append(res)
                print(f"  run {r} {mode:8s}: {res['req_s']:.3f} req/s ({res['wall']:.1f} s), hit {res['hit']:.1%}, "
                      f"image tokens hit {res['image_hit']:.1%}, {res['encoded']} images encoded in "
                      f"{res['encoder_s']:.2f} s")
        same = all(x["outputs"] == results["content"][0]["outputs"] for m in results.values() for x in m)
        best = {m: max(v, key=lambda x: x["req_s"]) for m, v in results.items()}
        c, u = best["content"], best["unshared"]
        print(f"best of {a.repeats}: content {c['req_s']:.3f} req/s vs unshared {u['req_s']:.3f} req/s = "
              f"{c['req_s'] / u['req_s']:.2f}x; hit {c['hit']:.1%} vs {u['hit']:.1%}; encoder "
              f"{c['encoder_s']:.2f} s vs {u['encoder_s']:.2f} s ({u['encoder_s'] - c['encoder_s']:.2f} s saved, "
              f"{c['encoded']} vs {u['encoded']} images encoded); same outputs: {same}")


if __name__ == "__main__":
    main()
