"""The image-embedding LRU: order, byte bound, one encoder call for the misses, real features."""

from __future__ import annotations

import threading

import pytest
import torch
from PIL import Image

from radixserve.model.vision.image_embed_cache import ImageEmbeddingCache


def _t(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.float32)  # 4 * n bytes


def test_lru_order_and_byte_bound() -> None:
    c = ImageEmbeddingCache(capacity_bytes=40)  # ten floats
    assert c.put("a", _t(4, 1)) and c.put("b", _t(4, 2))
    assert c.get("a") is not None  # a is now the most recent: b goes first
    assert c.put("c", _t(3, 3))  # 16 + 16 + 12 > 40
    assert "b" not in c and "a" in c and "c" in c
    s = c.stats()
    assert (s.entries, s.bytes, s.evictions, s.hits) == (2, 28, 1, 1)
    assert c.get("b") is None and c.stats().misses == 1
    assert not c.put("huge", _t(11))  # larger than the whole cache: not stored, nothing evicted
    assert len(c) == 2
    assert c.put("a", _t(10, 5))  # replacing counts the new size only
    assert len(c) == 1 and c.stats().bytes == 40 and torch.equal(c.get("a"), _t(10, 5))
    c.clear()
    assert len(c) == 0 and c.stats().bytes == 0


def test_zero_capacity_stores_nothing_and_bad_capacity_is_refused() -> None:
    c = ImageEmbeddingCache(0)
    assert not c.put("a", _t(1)) and c.get("a") is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="capacity_bytes"):
            ImageEmbeddingCache(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="features"):
        c.put("a", [1.0])  # type: ignore[arg-type]


def test_get_or_compute_runs_one_call_for_distinct_misses() -> None:
    c = ImageEmbeddingCache(1 << 20)
    c.put("x", _t(3, 9))
    calls: list[list[int]] = []

    def compute(idx: list[int]) -> torch.Tensor:
        calls.append(idx)
        return torch.stack([_t(3, float(i)) for i in idx])

    out = c.get_or_compute(["y", "x", "z", "y"], compute)
    assert calls == [[0, 2]]  # y once, z once, x from the cache
    assert [float(t[0]) for t in out] == [0.0, 9.0, 2.0, 0.0]
    assert c.get_or_compute(["z", "y"], compute)[1].equal(_t(3, 0)) and len(calls) == 1
    with pytest.raises(ValueError, match="expected 1 rows"):
        c.get_or_compute(["new"], lambda idx: torch.zeros(2, 3))


def test_threads_share_one_cache() -> None:
    c = ImageEmbeddingCache(4 * 50)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(300):
                k = (seed * 7 + i) % 80
                if c.get(k) is None:
                    c.put(k, _t(5, float(k)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = c.stats()
    assert s.bytes == 20 * s.entries <= 200
    assert all(float(c.get(k)[0]) == k for k in list(c._entries))


def test_real_encoder_features_come_back_equal(tmp_path) -> None:
    """With the tiny LLaVA's encoder: a hit returns exactly what the encoder computed."""
    from radixserve.model.arch.factory import create_vlm
    from radixserve.model.vision.image_processor import image_content_hash, preprocess
    from radixserve.model.registry import load_model
    from radixserve.model.testing.tiny_llava import write_tiny_llava

    m = load_model(str(write_tiny_llava(tmp_path / "m")))
    vlm = create_vlm(m.config, m.state_dict, m.vision)
    g = torch.Generator().manual_seed(0)
    imgs = [Image.fromarray(torch.randint(0, 256, (40, 50, 3), generator=g, dtype=torch.uint8).numpy())
            for _ in range(3)]
    keys = [image_content_hash(im, m.vision.processor) for im in imgs]
    cache = ImageEmbeddingCache(1 << 20)
    encoded: list[int] = []

    def encode(idx: list[int]) -> torch.Tensor:
        encoded.extend(idx)
        return vlm.encode_images(preprocess([imgs[i] for i in idx], m.vision.processor))

    first = cache.get_or_compute(keys[:2], encode)
    again = cache.get_or_compute(keys, encode)
    assert encoded == [0, 1, 2]
    direct = vlm.encode_images(preprocess(imgs, m.vision.processor))
    for a, d in zip(again, direct):  # batches of 2 + 1 against one of 3: the same rows
        torch.testing.assert_close(a, d, atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again[:2]))
