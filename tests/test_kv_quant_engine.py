"""Quantized KV through the whole engine: exactness stays a contract for the same KV dtype.

Greedy output with the prefix cache on equals the output with it off (int8 and fp8 KV, real
SmolLM2 with float32 weights), through eviction and retraction, and through HiCache tier
moves (L2, and L3 after a restart): the quantized KV is deterministic, and the scales travel
inside the slot rows. L3 objects carry their KV dtype; a damaged scale is caught by the object
checks and by ``check_integrity``; tensor-parallel ranks quantize their own heads alike.
"""

from __future__ import annotations

import random
import struct
import zlib

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.quant import dequantize
from radixserve.storage import objects
from radixserve.storage.keys import ModelFingerprint
from radixserve.storage.objects import ObjectError, decode_page, encode_page

SYSTEM = ("You are a careful assistant. Answer briefly and precisely. Facts: the Rhine flows "
          "through Switzerland, Germany and the Netherlands; the Danube flows through Vienna, "
          "Budapest and Belgrade. ")
QUESTIONS = ["Which river flows through Vienna?", "Name a country the Rhine flows through.",
             "Which river passes Budapest?", "Does the Danube flow through Belgrade?"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def chat_prompts(eng: Engine) -> list[list[int]]:
    return [eng.tokenizer.encode(eng.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def reference(request, smollm2_loaded):
    kind = request.param
    eng = Engine(smollm2_loaded, cache="none", dtype="float32", kv_cache_dtype=kind, kv_cache_tokens=4096)
    prompts = chat_prompts(eng)
    return kind, prompts, [o.token_ids for o in eng.generate(prompts, GREEDY)]


def test_cache_on_equals_cache_off_batch_and_one_by_one(smollm2_loaded, reference):
    kind, prompts, want = reference
    eng = Engine(smollm2_loaded, dtype="float32", kv_cache_dtype=kind, kv_cache_tokens=4096)
    assert eng.stats()["kv_cache_dtype"] == kind
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    one = [eng.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in one] == want
    assert all(o.cached_tokens >= len(p) - 1 for o, p in zip(one, prompts))
    eng.check_integrity()


def test_cache_on_equals_cache_off_under_eviction_and_retraction(smollm2_loaded, reference):
    kind, prompts, want = reference
    eng = Engine(smollm2_loaded, dtype="float32", kv_cache_dtype=kind,
                 kv_cache_tokens=max(len(p) for p in prompts) + 24, decode_reserve_ratio=0.0)
    outs = eng.generate(prompts, GREEDY)
    s = eng.stats()
    assert s["evicted_tokens"] > 0 and s["retractions"] > 0
    assert [o.token_ids for o in outs] == want
    eng.check_integrity()


def _hi_engine(loaded, kind: str, kv: int, l2: int, storage: str = "") -> Engine:
    return Engine(loaded, dtype="float32", kv_cache_dtype=kind, kv_cache_tokens=kv, decode_reserve_ratio=0.0,
                  hicache_l2_tokens=l2, hicache_storage=storage, hicache_storage_page_tokens=16,
                  hicache_prefetch_policy="wait_complete")


def test_tier_moves_and_warm_restart_equal_cache_off(smollm2_loaded, reference, tmp_path):
    """L1 holds one request: the system prompt is demoted to L2 / L3 and loaded back (codes
    and scales in one row copy), and after a restart served from the file store."""
    kind, prompts, want = reference
    kv = max(len(p) for p in prompts) + 16
    url = f"file://{tmp_path}/l3"
    eng = _hi_engine(smollm2_loaded, kind, kv, 64, url)
    outs = []
    for p in prompts:
        outs.append(eng.generate([p], GREEDY)[0])
        eng.check_integrity()
    assert [o.token_ids for o in outs] == want
    assert all(o.cached_tokens > 0 for o in outs[1:])
    assert eng.cache.stats()["tokens_moved"]["load_back"] > 0
    assert eng.cache.wait_storage_idle(10)
    eng.cache.close()
    again = _hi_engine(smollm2_loaded, kind, kv, kv, url)
    first = again.generate([prompts[0]], GREEDY)[0]
    assert first.token_ids == want[0] and first.cached_tokens >= 32
    assert again.cache.stats()["prefetch"]["tokens"] >= first.cached_tokens
    again.cache.close()
    # The same store seen by a server of another KV dtype: nothing is shared (other keys,
    # and an object fetched under a key anyway is refused as foreign).
    other = "fp8_e4m3" if kind == "int8" else "int8"
    eng3 = _hi_engine(smollm2_loaded, other, kv, kv, url)
    assert eng3.generate([prompts[0]], GREEDY)[0].cached_tokens == 0
    eng3.cache.close()


# --------------------------------------------------------------------------- L3 objects
def _page(kind: str, seed: int = 0) -> tuple[ModelFingerprint, torch.Tensor]:
    pool = KVPool(2, 32, 3, 16, kind)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(8)
    for layer in range(2):
        pool.write(layer, slots, torch.randn(8, 3, 16, generator=gen), torch.randn(8, 3, 16, generator=gen))
    fp = ModelFingerprint.for_pool("m", pool, 8)
    return fp, pool.kv[:, :, :8].contiguous()


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_objects_round_trip_codes_and_scales(kind):
    fp, data = _page(kind)
    assert fp.dtype == kind and fp.page_shape == (2, 2, 8, 3, 20)
    key = bytes(range(32))
    page = decode_page(encode_page(key, fp, data), key, fp)
    assert torch.equal(page.data, data)
    assert torch.equal(dequantize(page.data, kind), dequantize(data, kind))


def _refresh_crcs(blob: bytearray) -> bytes:
    """Recompute both checksums (a writer that wrote a bad scale, rather than a damaged file)."""
    payload = bytes(blob[objects.HEADER_SIZE:])
    fields = list(objects._HEAD.unpack_from(blob, 0))
    fields[-1] = zlib.crc32(payload)
    head = objects._HEAD.pack(*fields)
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_a_corrupted_scale_is_detected(kind):
    fp, data = _page(kind, 1)
    key = bytes(32)
    blob = bytearray(encode_page(key, fp, data))
    # the first row's scale: bytes 16..19 of the payload
    at = objects.HEADER_SIZE + 16
    damaged = bytearray(blob)
    damaged[at + 3] ^= 0x80  # the sign bit: a negative scale
    with pytest.raises(ObjectError) as e:
        decode_page(bytes(damaged), key, fp)
    assert e.value.reason == "corrupt" and "checksum" in str(e.value)
    with pytest.raises(ObjectError) as e:
        decode_page(_refresh_crcs(damaged), key, fp)
    assert e.value.reason == "corrupt" and "scale" in str(e.value)
    nan = bytearray(blob)
    nan[at : at + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(ObjectError, match="scale"):
        decode_page(_refresh_crcs(nan), key, fp)


def test_an_object_of_another_kv_dtype_is_foreign():
    fp_int8, data = _page("int8")
    fp_other = ModelFingerprint("m", "fp8_e4m3", 2, 3, 16, 8)
    blob = encode_page(bytes(32), fp_int8, data)
    with pytest.raises(ObjectError) as e:
        decode_page(blob, bytes(32), fp_other)
    assert e.value.reason == "foreign" and "KV dtype int8" in str(e.value)
    assert fp_other.digest != fp_int8.digest  # and it is never even asked for: other keys


def test_check_integrity_knows_the_scales(tiny_loaded):
    eng = Engine(tiny_loaded, dtype="float32", kv_cache_dtype="int8", kv_cache_tokens=512)
    rng = random.Random(0)
    eng.generate([[rng.randrange(3, 500) for _ in range(40)]], SamplingParams(max_tokens=4, temperature=0))
    eng.check_integrity()
    pool = eng.core.runner.kv_pool
    slot = int(eng.core.allocator.written.nonzero()[0])
    pool.kv[1, 0, slot, 0, pool.head_dim : pool.head_dim + 4] = torch.tensor(
        [0.0], dtype=torch.float32).view(torch.uint8)  # scale 0: never written by a quantizer
    with pytest.raises(AssertionError, match=f"slot {slot}"):
        eng.check_integrity()


def test_tp2_int8_equals_tp1() -> None:
    rng = random.Random(2)
    prefix = [rng.randrange(3, 500) for _ in range(50)]
    prompts = [prefix[: rng.randint(10, 50)] + [rng.randrange(3, 500) for _ in range(rng.randint(5, 30))]
               for _ in range(8)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="int8", num_threads=1, kv_cache_tokens=300, decode_reserve_ratio=0.0)
    want = [o.token_ids for o in Engine("tiny-random", **kw).generate(prompts, sp)]
    with Engine("tiny-random", tp_size=2, **kw) as eng:
        assert [o.token_ids for o in eng.generate(prompts, sp)] == want
        eng.check_integrity()


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine("tiny-random", kv_cache_dtype="int4")

