"""The standalone router in front of two tiny-random-llava workers: an image's questions go
to the worker whose tree holds the image (the router hashes images as the workers do)."""

from __future__ import annotations

import base64
import io

import httpx
import torch
from PIL import Image

from router_workers import running_router, running_workers, wait_for

MODEL = "tiny-random-llava"
TOKENS_PER_IMAGE = 25


def _uri(seed: int, level: int = 6) -> str:
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (32, 40, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr, mode="RGB").save(buf, format="PNG", compress_level=level)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_router_sends_an_images_questions_where_it_is_cached():
    with running_workers(2, model=MODEL, kv_cache_tokens=4096) as workers, \
            running_router([w.url for w in workers], [w.events for w in workers], health_interval_s=0.2) as r:
        wait_for(lambda: r.call(lambda rt: all(w.mirror.synced and w.healthy for w in rt.workers)),
                 30, "mirrors in sync")
        with httpx.Client(base_url=r.url, timeout=60) as client:
            routed: dict[int, list[int]] = {}
            cached: dict[int, list[int]] = {}
            for q, level in (("What is it?", 6), ("Which colour?", 1), ("How many?", 9)):
                for img in range(4):
                    before = r.call(lambda rt: [w.routed for w in rt.workers])
                    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _uri(img, level)}},
                                                     {"type": "text", "text": q}]}]}
                    out = client.post("/v1/chat/completions", json=body)
                    assert out.status_code == 200, out.text
                    after = r.call(lambda rt: [w.routed for w in rt.workers])
                    routed.setdefault(img, []).append([a - b for a, b in zip(after, before)].index(1))
                    cached.setdefault(img, []).append(out.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                    # The router's keys for this request are the ones the worker's tree now
                    # holds (its events reach the mirror shortly after the response).
                    w = routed[img][-1]

                    def held(rt, body=body, w=w):  # noqa: ANN001, ANN202
                        tokens, salt = rt.tokenizer.for_path("/v1/chat/completions", body)
                        return rt.workers[w].mirror.match(tokens, salt).get("L1", 0)  # empty tree: no key

                    wait_for(lambda: r.call(held) >= TOKENS_PER_IMAGE, 10, "the image in the mirror")
            # Another PNG level of the same pixels is the same image: every question of an
            # image went to one worker, and the later ones hit its tokens there.
            assert all(len(set(ws)) == 1 for ws in routed.values()), routed
            assert len({ws[0] for ws in routed.values()}) == 2, routed  # new images were dealt out
            assert all(c >= TOKENS_PER_IMAGE for cs in cached.values() for c in cs[1:]), cached
