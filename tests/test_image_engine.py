"""Images through the engine: content keys in the prefix tree, the encoder LRU, exactness.

The model is the seeded tiny-random-llava (25 image tokens per image); references are the
same engine without a cache, and transformers' ``LlavaForConditionalGeneration`` on the same
folder for the greedy tokens.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.images import KEY_BASE, ImageInput, clip_match, expand_prompt, image_tokens_in, span_keys

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TPI = 25  # tokens per image of tiny-random-llava


def _image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(arr, mode="RGB")


def _png(img: Image.Image, level: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=level)
    return buf.getvalue()


@pytest.fixture(scope="module")
def engines():
    eng = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=4096)
    ref = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=4096, cache="none")
    return eng, ref


def _one(eng: Engine, prompt: str, images, params: SamplingParams = GREEDY, salt: str | None = None):
    return eng.generate(prompt, params, images=images, salt=salt)[0]


# --------------------------------------------------------------------------- keys
def test_span_keys_are_out_of_vocabulary_and_distinct():
    a, b = span_keys("ab" * 32, 600), span_keys("ac" * 32, 600)
    assert len(a) == 600 and all(KEY_BASE <= k < 2**32 for k in a)
    assert a == span_keys("ab" * 32, 600) and a != b
    assert len(set(a)) > 590  # position-dependent, not one repeated key


def test_expand_prompt_and_clipping():
    ids, spans = expand_prompt([1, 9, 2, 9], 9, 7, ["k1", "k2"])
    assert ids == [1] + [9] * 7 + [2] + [9] * 7
    assert [(s.offset, s.end, s.key) for s in spans] == [(1, 8, "k1"), (9, 16, "k2")]
    # A match stops before an image or covers >= MIN_KEY_POSITIONS (5) of its positions.
    assert [clip_match(n, spans) for n in range(17)] == [0, 1, 1, 1, 1, 1, 6, 7, 8, 9, 9, 9, 9, 9, 14, 15, 16]
    assert image_tokens_in(10, spans) == 8
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_prompt([9, 9], 9, 3, ["k"])


# --------------------------------------------------------------------------- hits
def test_same_image_twice_hits_and_equals_the_uncached_run(engines):
    eng, ref = engines
    eng.core.flush_cache()
    img = _image(1)
    prompt = "Look: <image> what is it?"
    first = _one(eng, prompt, [img])
    before = eng.stats()["images_encoded"]
    second = _one(eng, prompt, [img])
    want = _one(ref, prompt, [img])
    assert first.cached_tokens == 0
    n_text_before = eng.tokenizer.encode("Look: ").__len__()
    assert second.cached_tokens >= n_text_before + TPI  # covers the image tokens
    assert second.cached_tokens == second.prompt_tokens - 1
    assert first.token_ids == second.token_ids == want.token_ids
    assert eng.stats()["images_encoded"] == before  # the tree served it: no encoder run
    eng.core.check_integrity()


def test_same_pixels_other_png_level_hit_one_pixel_misses(engines):
    eng, ref = engines
    eng.core.flush_cache()
    img = _image(2)
    prompt = "<image> describe"
    _one(eng, prompt, [_png(img, 9)])
    again = _one(eng, prompt, [_png(img, 1)])
    assert again.cached_tokens >= TPI
    changed = img.copy()
    changed.putpixel((5, 5), tuple((c + 1) % 256 for c in img.getpixel((5, 5))))
    miss = _one(eng, prompt, [_png(changed, 9)])
    assert miss.cached_tokens == 0
    assert miss.token_ids == _one(ref, prompt, [changed]).token_ids
    eng.core.check_integrity()


def test_image_at_another_position_reuses_the_encoder_output(engines):
    """After another prefix the tree cannot help, but the encoder LRU does; same output."""
    eng, ref = engines
    img = _image(3)
    _one(eng, "first <image> ?", [img])
    enc = eng.stats()["images_encoded"]
    other = _one(eng, "a different start, then <image> ?", [img])
    assert eng.stats()["images_encoded"] == enc
    assert other.token_ids == _one(ref, "a different start, then <image> ?", [img]).token_ids


def test_tenants_never_share_an_images_kv_or_features(engines):
    eng, _ = engines
    img = _image(4)
    _one(eng, "<image> tenant check", [img], salt="tenant-a")
    enc = eng.stats()["images_encoded"]
    b = _one(eng, "<image> tenant check", [img], salt="tenant-b")
    assert b.cached_tokens == 0
    assert eng.stats()["images_encoded"] == enc + 1  # not the other tenant's features either
    a2 = _one(eng, "<image> tenant check", [img], salt="tenant-a")
    assert a2.cached_tokens >= TPI


def test_several_images_and_their_order(engines):
    eng, ref = engines
    imgs = [_image(5), _image(6, (64, 33)), _image(7, (20, 50))]
    prompt = "<image> then <image> and <image>: which differ?"
    out = _one(eng, prompt, imgs)
    assert out.prompt_tokens == len(eng.tokenizer.encode(prompt)) + 3 * (TPI - 1)
    assert out.token_ids == _one(ref, prompt, imgs).token_ids
    swapped = _one(eng, prompt, [imgs[1], imgs[0], imgs[2]])
    assert swapped.cached_tokens < TPI  # the first image differs: nothing past it is shared
    assert swapped.token_ids == _one(ref, prompt, [imgs[1], imgs[0], imgs[2]]).token_ids


def test_greedy_tokens_equal_transformers():
    transformers = pytest.importorskip("transformers")
    from radixserve.model.testing.tiny_llava import tiny_llava_dir

    path = tiny_llava_dir()
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32).eval()
    proc_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    proc = proc_cls.from_pretrained(str(path))
    eng = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=1024)
    imgs = [_image(8), _image(9, (33, 61))]
    prompt = "<|im_start|>user\n<image> and <image>: what changed?<|im_end|>\n"
    out = eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), images=imgs)[0]
    ids = expand_prompt(eng.tokenizer.encode(prompt), 519, TPI, ["x" * 32, "y" * 32])[0]
    with torch.inference_mode():
        seq = hf.generate(input_ids=torch.tensor([ids]), pixel_values=proc(images=imgs, return_tensors="pt")["pixel_values"],
                          max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.token_ids == seq[0, len(ids):].tolist()


# --------------------------------------------------------------------------- partial matches
@pytest.mark.parametrize("into", [3, 10])
def test_a_match_ending_inside_an_image(into):
    """A chunk boundary ``into`` positions inside the image leaves that part of it in the tree
    (the request is aborted after its first chunk). The next request reuses it when it
    covers >= 5 positions (enough key bits), else only the text before it; same output."""
    ref = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=1024, cache="none")
    prompt = "0123456 <image> tail"
    pre = len(ref.tokenizer.encode("0123456 "))
    eng = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=1024, chunked_prefill_size=pre + into,
                 max_prefill_tokens=pre + into)
    img = _image(10)
    rid = eng.add_request(prompt, GREEDY, images=[img])
    eng.step()  # the first chunk: the text and part of the image
    assert eng.core.requests[rid].kv_written == pre + into
    eng.abort(rid)
    eng.step()
    assert eng.core.cache.total_size == pre + into  # the partial image is in the tree
    out = _one(eng, prompt, [img])
    assert out.cached_tokens == (pre if into < 5 else pre + into)
    assert out.token_ids == _one(ref, prompt, [img]).token_ids
    eng.core.check_integrity()


def test_content_keys_off_never_share_images():
    eng = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=1024, image_content_keys=False,
                 image_cache_bytes=0)
    img = _image(11)
    prompt = "some words <image> ?"
    a, b = _one(eng, prompt, [img]), _one(eng, prompt, [img])
    assert b.cached_tokens == len(eng.tokenizer.encode("some words "))
    assert a.token_ids == b.token_ids
    assert eng.stats()["images_encoded"] == 2


# --------------------------------------------------------------------------- bad input
def test_bad_image_requests_are_refused_and_change_nothing(engines, tiny_loaded):
    eng, _ = engines
    img = _image(12)
    with pytest.raises(ValueError, match="placeholder"):
        _one(eng, "no placeholder here", [img])
    with pytest.raises(ValueError, match="placeholder"):
        _one(eng, "<image> <image>", [img])
    with pytest.raises(ValueError, match="pixel_values must be"):
        eng.add_request("<image>", GREEDY, images=[ImageInput("ab" * 32, torch.zeros(3, 8, 8))])
    with pytest.raises(ValueError, match="cannot be decoded"):
        eng.add_request("<image>", GREEDY, images=[b"not a png"])
    text = Engine(tiny_loaded, dtype="float32", kv_cache_tokens=256)
    with pytest.raises(ValueError, match="does not accept images"):
        text.add_request([5, 6, 7], GREEDY, images=[img])
    assert not eng.has_unfinished() and not text.has_unfinished()
    eng.core.check_integrity()
    assert _one(eng, "<image> still fine", [img]).finish_reason == "length"


# --------------------------------------------------------------------------- random mixes
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**31 - 1))
def test_random_image_mixes_under_pressure_equal_the_uncached_run(engines, seed):
    """Requests mixing 3 images and 3 texts in a small pool (evictions, retractions, chunks
    splitting images), random aborts: outputs equal the no-cache engine's, integrity holds."""
    rng = random.Random(seed)
    _, ref = engines
    eng = Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=192, chunked_prefill_size=16,
                 max_prefill_tokens=32, decode_reserve_ratio=0.0, page_size=rng.choice([1, 4]),
                 image_cache_bytes=rng.choice([0, 1 << 20]))
    imgs = [_image(20 + i) for i in range(3)]
    texts = ["alpha ", "beta gamma ", "delta "]
    want: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}

    def collect(outs) -> None:
        got.update({o.request_id: o.token_ids for o in outs if o.finished and o.finish_reason == "length"})

    for _ in range(10):
        k = rng.randint(0, 2)
        parts = [rng.choice(texts) + "<image>" for _ in range(k)] + [rng.choice(texts)]
        pick = [rng.choice(imgs) for _ in range(k)]
        prompt = " ".join(parts)
        params = SamplingParams(max_tokens=rng.randint(4, 40), temperature=0, ignore_eos=True)
        rid = eng.add_request(prompt, params, images=pick)
        want[rid] = _one(ref, prompt, pick, params).token_ids
        for _ in range(rng.randint(0, 3)):
            collect(eng.step())
            eng.core.check_integrity()
        if rng.random() < 0.15 and eng.abort(rid):
            want.pop(rid)
    collect(eng.run_until_done())
    eng.core.check_integrity()
    assert got and set(got) <= set(want)
    assert all(got[r] == want[r] for r in got)
    stats["retractions"] += eng.stats()["retractions"]
    stats["image_hits"] += eng.stats()["cached_image_tokens"]


stats = {"retractions": 0, "image_hits": 0}


def test_the_random_mixes_retracted_and_hit_images():
    """The random test above reached what it is about (it runs first: file order)."""
    if not stats["image_hits"] and not stats["retractions"]:
        pytest.skip("the random test did not run")
    assert stats["retractions"] > 0 and stats["image_hits"] > 0


# --------------------------------------------------------------------------- HiCache tiers
def test_images_through_hicache_tiers_hit_and_stay_exact(engines, tmp_path):
    """A small L1 over host memory (L2) and a file store (L3): images pushed out of L1 come
    back from the lower tiers by their content keys; a fresh engine on the same store hits
    the image from L3; outputs equal the uncached run."""
    _, ref = engines
    store = "file://" + str(tmp_path / "l3")

    def hi() -> Engine:
        return Engine("tiny-random-llava", dtype="float32", kv_cache_tokens=48, decode_reserve_ratio=0.0,
                      hicache_l2_tokens=1024, hicache_storage=store, hicache_write_through_threshold=1,
                      hicache_storage_page_tokens=8, page_size=8, hicache_prefetch_policy="wait_complete",
                      image_cache_bytes=0)

    eng = hi()
    imgs = [_image(30 + i) for i in range(3)]
    prompts = [(f"<image> q{i % 2} ?", imgs[i % 3]) for i in range(7)]
    outs = [_one(eng, p, [im]) for p, im in prompts]
    for (p, im), o in zip(prompts, outs):
        assert o.token_ids == _one(ref, p, [im]).token_ids
        eng.core.check_integrity()
    assert eng.stats()["cached_image_tokens"] > 0
    lower = sum((o.cached_by_tier or {}).get("L2", 0) + (o.cached_by_tier or {}).get("L3", 0) for o in outs)
    assert lower >= TPI, [o.cached_by_tier for o in outs]  # some image came back from below L1
    eng.core.close()
    fresh = hi()
    again = _one(fresh, prompts[0][0], [prompts[0][1]])
    assert again.cached_tokens >= 24 and again.cached_by_tier  # 24: pages of 8 and again.cached_by_tier.get("L3", 0) > 0
    assert again.token_ids == outs[0].token_ids
    fresh.core.close()
