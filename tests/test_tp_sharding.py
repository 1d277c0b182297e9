"""Sharding rules of tensor parallelism: head splits (uneven, replicated KV heads), the
intermediate and vocabulary splits, the step message, and sharded forwards that equal the
whole model (shards run on threads here; ``test_tp_engine.py`` runs real processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tp_helpers import ThreadShards

from radixserve.memory.kv_pool import KVPool
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.registry import expected_shapes
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
from radixserve.parallel.sharding import (
    head_split,
    lm_head_shard,
    plan_shards,
    shard_config,
    shard_state_dict,
    split_even,
    vocab_split,
)
from radixserve.parallel.wire import BatchDigest, decode_forward, encode_forward


@given(st.integers(0, 200), st.integers(1, 20))
def test_split_even_is_contiguous_and_balanced(n: int, parts: int) -> None:
    runs = split_even(n, parts)
    assert len(runs) == parts
    assert [i for r in runs for i in r] == list(range(n))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1


@settings(max_examples=300)
@given(st.integers(1, 16), st.integers(1, 8), st.data())
def test_head_split_rules(num_kv: int, group: int, data: st.DataObject) -> None:
    num_heads = num_kv * group
    size = data.draw(st.integers(1, num_heads))
    split = head_split(num_heads, num_kv, size)
    assert len(split) == size
    # Query heads: every head exactly once, in order, at least one per rank.
    assert [h for q, _ in split for h in q] == list(range(num_heads))
    assert all(len(q) >= 1 for q, _ in split)
    for q, kv in split:
        # The rank's heads map onto its KV heads in equal contiguous groups (a valid GQA shard).
        assert len(kv) >= 1 and len(q) % len(kv) == 0
        local_group = len(q) // len(kv)
        for i, h in enumerate(q):
            assert h // group == kv.start + i // local_group
    kv_sets = [set(kv) for _, kv in split]
    if size <= num_kv:  # no KV head stored twice, counts differ by at most one
        assert sorted(h for s in kv_sets for h in s) == list(range(num_kv))
        assert max(map(len, kv_sets)) - min(map(len, kv_sets)) <= 1
    else:  # one KV head per rank, each replicated on size // num_kv or one more ranks
        assert all(len(s) == 1 for s in kv_sets)
        copies = [sum(h in s for s in kv_sets) for h in range(num_kv)]
        assert set(copies) <= {size // num_kv, size // num_kv + 1}


def test_head_split_smollm2_shapes() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads (groups of 3).
    assert head_split(9, 3, 1) == [(range(9), range(3))]
    assert head_split(9, 3, 2) == [(range(6), range(2)), (range(6, 9), range(2, 3))]  # uneven
    assert head_split(9, 3, 3) == [(range(3 * r, 3 * r + 3), range(r, r + 1)) for r in range(3)]
    # 4 ranks: KV head 0 replicated on ranks 0 and 1, which split its 3 query heads 2 + 1.
    assert head_split(9, 3, 4) == [(range(2), range(1)), (range(2, 3), range(1)),
                                   (range(3, 6), range(1, 2)), (range(6, 9), range(2, 3))]


def test_impossible_splits_are_value_errors() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 9 attention heads"):
        head_split(9, 3, 10)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        head_split(9, 3, 0)
    with pytest.raises(ValueError, match="intermediate size"):
        plan_shards(tiny_random_config(num_heads=8, num_kv_heads=2, intermediate_size=4), 8)


@pytest.mark.parametrize("vocab,size", [(512, 2), (513, 2), (512, 3), (5, 4), (49152, 2)])
def test_vocab_split_pads_the_last_rank(vocab: int, size: int) -> None:
    runs, per = vocab_split(vocab, size)
    assert per == -(-vocab // size)  # ceil: the last rank(s) padded
    assert [i for r in runs for i in r] == list(range(vocab))
    assert all(len(r) <= per for r in runs)
    cfg = tiny_random_config(vocab_size=vocab, num_heads=4, num_kv_heads=4)
    sd = tiny_random_state_dict(0, cfg)
    for shard in plan_shards(cfg, size):
        w = lm_head_shard(cfg, sd, shard)
        assert w.shape == (per, cfg.hidden_size)
        assert torch.equal(w[: len(shard.vocab)], sd["model.embed_tokens.weight"][shard.vocab.start : shard.vocab.stop])
        assert not w[len(shard.vocab) :].any()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shard_state_dict_has_the_shard_configs_shapes(arch: str) -> None:
    cfg = tiny_random_config(arch, num_heads=9, num_kv_heads=3, intermediate_size=130,
                             tie_word_embeddings=arch == "llama")
    sd = tiny_random_state_dict(0, cfg)
    plan = plan_shards(cfg, 4)
    assert [len(s.intermediate) for s in plan] == [33, 33, 32, 32]
    for shard in plan:
        part = shard_state_dict(cfg, sd, shard)
        want = expected_shapes(shard_config(cfg, shard))
        assert {k: tuple(v.shape) for k, v in part.items()} == want
    # Column slices of o_proj over all ranks rebuild the whole matrix.
    o = sd["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(torch.cat([shard_state_dict(cfg, sd, s)["model.layers.0.self_attn.o_proj.weight"]
                                  for s in plan], dim=1), o)


def _batches() -> list[ForwardBatch]:
    """A prefill, then decode rows and a prefill over a cached prefix in one mixed batch."""
    return [
        ForwardBatch.build([[1, 2, 3, 4, 5, 6, 7], [9, 8]], [0, 0], [torch.arange(0, 7), torch.arange(7, 9)],
                           return_all_logits=[True, False]),
        ForwardBatch.build([[11], [12, 13, 14]], [7, 2], [torch.arange(0, 8), torch.cat((torch.arange(7, 9),
                           torch.arange(20, 23)))], return_all_logits=[False, True]),
        ForwardBatch.build([[15], [16]], [8, 5], [torch.arange(0, 9), torch.cat((torch.arange(7, 9),
                           torch.arange(20, 24)))], need_logits=[True, False]),
    ]


CASES = [
    ("tiny 4/2 heads", {}, 2),
    ("tiny, 4 ranks: KV heads replicated", {}, 4),
    ("tiny, 3 ranks: uneven heads", {}, 3),
    ("9/3 heads (SmolLM2's), 2 ranks: uneven, odd vocabulary", {"num_heads": 9, "num_kv_heads": 3, "vocab_size": 513}, 2),
    ("qwen2 biases, untied, 9/3 heads on 4 ranks", {"arch": "qwen2", "num_heads": 9, "num_kv_heads": 3,
                                                        "vocab_size": 511, "tie_word_embeddings": False}, 4),
]


@pytest.mark.parametrize("backend", ["torch", "torch-eager"])
@pytest.mark.parametrize("name,overrides,size", CASES, ids=[c[0] for c in CASES])
def test_sharded_forward_equals_the_whole_model(name: str, overrides: dict, size: int, backend: str) -> None:
    arch = overrides.pop("arch", "llama") if "arch" in overrides else "llama"
    overrides = {k: v for k, v in overrides.items() if k != "arch"}
    cfg = tiny_random_config(arch, **overrides)
    sd = tiny_random_state_dict(0, cfg)
    full = LlamaForCausalLM.from_state_dict(cfg, sd)
    pool = KVPool(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim)
    attn = make_attention_backend(backend)
    shards = ThreadShards(cfg, sd, size, capacity=64, backend=backend)
    assert [p.kv.shape[3] for p in shards.pools] == [s.num_kv_heads for s in shards.plan]
    for fb in _batches():
        want, got = full.forward(fb, pool, attn), shards.forward(fb)
        assert got.logits_seqs == want.logits_seqs
        assert got.next_token_logits.shape == (len(want.logits_seqs), cfg.vocab_size)
        torch.testing.assert_close(got.next_token_logits, want.next_token_logits, atol=1e-4, rtol=0)
        for a, b in zip(got.all_logits, want.all_logits):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert all(c.calls["all_reduce"] == 2 * cfg.num_layers * 3 for c in shards.comms)


def test_lm_head_on_rank0_alone_gives_the_same_logits() -> None:
    cfg = tiny_random_config(num_heads=9, num_kv_heads=3, vocab_size=513)
    sd = tiny_random_state_dict(0, cfg)
    full = LlamaForCausalLM.from_state_dict(cfg, sd)
    pool = KVPool(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim)
    attn = make_attention_backend("torch")
    shards = ThreadShards(cfg, sd, 2, capacity=64, lm_head="rank0")
    for fb in _batches():
        torch.testing.assert_close(shards.forward(fb).next_token_logits,
                                   full.forward(fb, pool, attn).next_token_logits, atol=1e-4, rtol=0)
    assert all(c.calls["gather"] == 0 for c in shards.comms)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6), st.booleans(), st.booleans()),
                min_size=1, max_size=5))
def test_step_message_round_trip(seqs: list[tuple[int, int, bool, bool]]) -> None:
    slot = iter(range(10_000))
    fb = ForwardBatch.build(
        [[(7 * p + i) % 500 for i in range(e)] for p, e, _, _ in seqs], [p for p, _, _, _ in seqs],
        [torch.tensor([next(slot) for _ in range(p + e)]) for p, e, _, _ in seqs],
        return_all_logits=[a and n for _, _, a, n in seqs], need_logits=[n for _, _, _, n in seqs])
    hdr, payload = encode_forward(fb, 3)
    got = decode_forward(hdr.tolist(), payload, torch.device("cpu"))
    for f in ("input_ids", "positions", "out_slots"):
        assert torch.equal(getattr(got, f), getattr(fb, f))
    assert all(torch.equal(a, b) for a, b in zip(got.seq_slots, fb.seq_slots))
    assert (got.prefix_lens, got.extend_lens, got.return_all_logits) == (fb.prefix_lens, fb.extend_lens,
                                                                         fb.return_all_logits)
    assert got.need_logits == fb.need_logits
    with pytest.raises(ValueError, match="step payload"):
        decode_forward(hdr.tolist(), payload[:-1], torch.device("cpu"))


def test_digest_sees_any_slot_change() -> None:
    fb = _batches()[1]
    a, b, c = BatchDigest(), BatchDigest(), BatchDigest()
    _, payload = encode_forward(fb, 1)
    a.update(1, payload, fb.num_seqs)
    b.update(1, encode_forward(decode_forward(encode_forward(fb, 1)[0].tolist(), payload, torch.device("cpu")), 1)[1], fb.num_seqs)
    assert a.value() == b.value()
    moved = payload.clone()
    moved[-1] += 1  # the last sequence's last slot
    c.update(1, moved, fb.num_seqs)
    assert c.value() != a.value()
