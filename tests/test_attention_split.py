"""Split invariance, bit for bit: a query row's result depends only on its q and the K/V at
positions up to its own — not on how the sequence was cut into a cached prefix and new
tokens, into chunks, or decode steps, nor on which other sequences share the batch.

That is the property that makes greedy output with the prefix cache on equal to output with
it off. Checked twice: at the attention backend (random q/k/v, every kernel implementation,
both kernel layouts — many rows per work item, and few as in decode), and through the whole
tiny model in float32 and bfloat16 (embedding, packed linears, fused row-wise ops, attention).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_paths import ALL_IMPLS, impl_id, require_impl
from helpers_model import shuffled_allocator
from radixserve.engine.runner import ModelRunner
from radixserve.memory.kv_pool import KVPool
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.model.arch.attention_kernel import TorchAttentionBackend
from radixserve.model.arch.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")

# (prefix, new tokens) cuts of one 150-token sequence: whole, prefix + tail (tails on and off
# the 32-key block boundaries), chunks, decode steps.
N = 150
SPLITS = [
    [N],
    [1, N - 1],
    [32, N - 32],
    [33, 117],
    [100, 49, 1],
    [17, 17, 17, 17, 17, 17, 17, 17, 14],
    [140] + [1] * 10,
]


def _backend_rows(impl: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                  split: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, 400, kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(400, generator=gen)[:N].clone()
    q = torch.randn(N, heads, head_dim, generator=gen)
    k = torch.randn(N, kv_heads, head_dim, generator=gen)
    v = torch.randn(N, kv_heads, head_dim, generator=gen)
    backend = TorchAttentionBackend(kernels=True, attention_impl=impl)
    outs, done = [], 0
    for n in split:
        batch = ForwardBatch.build([[0] * n], [done], [slots[: done + n]])
        meta = backend.prepare(batch, pool)
        sl = slice(done, done + n)
        outs.append(backend.forward(q[sl].to(dtype), k[sl].to(dtype), v[sl].to(dtype), 0, pool, meta))
        done += n
    return torch.cat(outs)


@pytest.mark.parametrize("impl", ALL_IMPLS, ids=impl_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (8, 8, 32), (6, 2, 24)])
def test_backend_rows_do_not_depend_on_the_split(impl, dtype, heads, kv_heads, head_dim):
    require_impl(impl, dtype, head_dim)
    whole = _backend_rows(impl, dtype, heads, kv_heads, head_dim, SPLITS[0])
    for split in SPLITS[1:]:
        assert torch.equal(_backend_rows(impl, dtype, heads, kv_heads, head_dim, split), whole), split


def test_backend_rows_do_not_depend_on_batch_neighbours():
    """A decode row and a prefill chunk give the same bits alone and mixed with others."""
    gen = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16
    pool = KVPool(1, 600, 3, 64, dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    perm = torch.randperm(600, generator=gen)
    s_a, s_b, s_c = perm[:90].clone(), perm[90:300].clone(), perm[300:340].clone()
    q = torch.randn(60, 9, 64, generator=gen).to(dtype)
    kv = torch.randn(60, 3, 64, generator=gen).to(dtype)
    backend = TorchAttentionBackend(kernels=True)

    def run(batch: ForwardBatch, rows: slice) -> torch.Tensor:
        meta = backend.prepare(batch, pool)
        return backend.forward(q[rows], kv[rows], kv[rows], 0, pool, meta)

    # a: decode at position 89; b: 50 new tokens over a 160-token prefix; c: decode at 39
    mixed = run(ForwardBatch.build([[0], [0] * 50, [0]], [89, 160, 39], [s_a, s_b, s_c]), slice(0, 52))
    alone_a = run(ForwardBatch.build([[0]], [89], [s_a]), slice(0, 1))
    alone_b = run(ForwardBatch.build([[0] * 50], [160], [s_b]), slice(1, 51))
    alone_c = run(ForwardBatch.build([[0]], [39], [s_c]), slice(51, 52))
    assert torch.equal(mixed, torch.cat([alone_a, alone_b, alone_c]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_do_not_depend_on_the_split(tiny_config, tiny_state_dict, dtype):
    """All-position logits of one prompt, computed whole, as prefix + tail, in chunks and as
    decode steps, are bitwise equal. This needs every layer to be row-independent: the
    kernels are by construction; oneDNN's packed GEMMs are too on the shapes tested here
    (a single float32 row runs as two, see ``linear.onednn_linear``); our packed GEMM is by construction."""
    sd = {k: v.to(dtype) for k, v in tiny_state_dict.items()}
    runner = ModelRunner.from_config(tiny_config, sd, kv_capacity=512, dtype=dtype, backend="torch")
    assert runner.attn_backend.uses_kernels
    prompt = torch.randint(0, 512, (N,), generator=torch.Generator().manual_seed(2)).tolist()
    results = []
    for i, split in enumerate(SPLITS):
        slots = shuffled_allocator(512, seed=i).alloc(N)
        rows, done = [], 0
        for n in split:
            batch = ForwardBatch.build([prompt[done : done + n]], [done], [slots[: done + n]],
                                       return_all_logits=[True])
            rows.append(runner.forward(batch).all_logits[0])
            done += n
        results.append(torch.cat(rows))
    for split, got in zip(SPLITS[1:], results[1:]):
        assert torch.equal(got, results[0]), split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_decode_batch_equals_each_alone(dtype):
    """A decode batch of many sequences of random lengths (spread over all threads): every
    row equals the same sequence decoded alone."""
    gen = torch.Generator().manual_seed(3)
    n_seq = 4 * torch.get_num_threads() + 3
    lens = [int(x) for x in torch.randint(1, 120, (n_seq,), generator=gen)]
    pool = KVPool(1, sum(lens) + 8, 3, 64, dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    perm = torch.randperm(sum(lens) + 8, generator=gen)
    seq_slots, start = [], 0
    for n in lens:
        seq_slots.append(perm[start : start + n].clone())
        start += n
    q = torch.randn(n_seq, 9, 64, generator=gen).to(dtype)
    kv = torch.randn(n_seq, 3, 64, generator=gen).to(dtype)
    backend = TorchAttentionBackend(kernels=True)
    batch = ForwardBatch.build([[0]] * n_seq, [n - 1 for n in lens], seq_slots)
    together = backend.forward(q, kv, kv, 0, pool, backend.prepare(batch, pool))
    for i, n in enumerate(lens):
        alone = ForwardBatch.build([[0]], [n - 1], [seq_slots[i]])
        row = backend.forward(q[i : i + 1], kv[i : i + 1], kv[i : i + 1], 0, pool, backend.prepare(alone, pool))
        assert torch.equal(row, together[i : i + 1]), i


def _shared_prefix_decode(impl: int, kind: str, n_seq: int, prefix_len: int, cuts: list[int],
                          tails: list[int], other_first: list[bool], seed: int):
    """A decode batch whose sequences extend one cached prefix (the same slots, as sequences
    sharing a radix-tree prefix do): sequence i reads the first cuts[i] prefix slots (all of
    them when cuts[i] >= prefix_len), then tails[i] of its own, optionally after a slot of its
    own first. Returns (rows decoded together, the same rows decoded one sequence at a time)."""
    gen = torch.Generator().manual_seed(seed)
    capacity = prefix_len + sum(tails) + n_seq + 8
    pool = KVPool(1, capacity, 3, 64, kind)
    pool.write(0, torch.arange(capacity), torch.randn(capacity, 3, 64, generator=gen),
               torch.randn(capacity, 3, 64, generator=gen))
    perm = torch.randperm(capacity, generator=gen)
    prefix, own = perm[:prefix_len], perm[prefix_len:]
    seq_slots, used = [], 0
    for i in range(n_seq):
        head = own[used : used + 1] if other_first[i] else own[:0]
        used += len(head)
        tail = own[used : used + tails[i]]
        used += tails[i]
        seq_slots.append(torch.cat([head, prefix[: min(cuts[i], prefix_len)], tail]).clone())
    q = torch.randn(n_seq, 9, 64, generator=gen)
    kv = torch.randn(n_seq, 3, 64, generator=gen)
    backend = TorchAttentionBackend(kernels=True, attention_impl=impl)
    lens = [len(s) for s in seq_slots]
    batch = ForwardBatch.build([[0]] * n_seq, [n - 1 for n in lens], seq_slots)
    together = backend.forward(q, kv, kv, 0, pool, backend.prepare(batch, pool))
    alone = []
    for i, n in enumerate(lens):
        one = ForwardBatch.build([[0]], [n - 1], [seq_slots[i]])
        alone.append(backend.forward(q[i : i + 1], kv[i : i + 1], kv[i : i + 1], 0, pool, backend.prepare(one, pool)))
    return together, torch.cat(alone)


@pytest.mark.parametrize("impl", ALL_IMPLS, ids=impl_id)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_batch_sharing_prefix_slots_equals_each_alone(impl, kind, data):
    """Sequences that read the same prefix slots (a shared block may be computed once for all
    of them) give, row for row, the bits each gives decoded alone, and the portable path's."""
    pool_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}[kind]
    require_impl(impl, pool_dtype, 64)
    n_seq = data.draw(st.integers(2, 20), label="n_seq")
    prefix_len = data.draw(st.integers(0, 300), label="prefix_len")
    cuts = data.draw(st.lists(st.one_of(st.just(10_000), st.integers(0, 300)), min_size=n_seq, max_size=n_seq), label="cuts")
    tails = data.draw(st.lists(st.integers(1, 70), min_size=n_seq, max_size=n_seq), label="tails")
    other_first = data.draw(st.lists(st.booleans(), min_size=n_seq, max_size=n_seq), label="other_first")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    together, alone = _shared_prefix_decode(impl, kind, n_seq, prefix_len, cuts, tails, other_first, seed)
    assert torch.equal(together, alone)
    if impl != kernels.IMPL_BF16:  # the float32-mode paths equal the portable one bit for bit
        reference, _ = _shared_prefix_decode(kernels.IMPL_GENERIC, kind, n_seq, prefix_len, cuts, tails,
                                             other_first, seed)
        assert torch.equal(together, reference)
