"""Bamba (Mamba2 + attention) against transformers, the per-request recurrent state, and Mamba
state snapshots in the one tree.

The tiny hybrid (``tiny-random-mamba-hybrid``: two Mamba2 layers to one attention layer, Mamba
heads in two groups, RoPE on half of each head) is saved as a Hugging Face folder by
transformers' ``BambaForCausalLM``, read back by our loader, and run through the KV pool and
the state pool: prefill, chunked prefill, decode and ragged batches, each within 1e-4 of
transformers' float32 logits, and bit for bit the same however the tokens were split into
steps or batched (the property that makes a cached state the state a request would compute).

In the engine, greedy tokens and logprobs with the Mamba radix cache equal those without a
cache, batched or alone, with free state slots poisoned with NaN (a request that started
from a slot it did not initialise would turn its logits into NaN); snapshots are hit at each
turn of a conversation and at a shared prefix, eviction under a tiny snapshot budget costs
hits only, and the integrity checks see every state slot.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import SamplingParams
from radixserve.cache.mamba import MambaRadixCache
from radixserve.config import EngineConfig
from radixserve.engine.core import EngineCore
from radixserve.engine.engine import Engine
from radixserve.engine.runner import ModelRunner
from radixserve.memory.allocator import SlotAllocator
from radixserve.model.arch.bamba import make_state_pool
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.loaders.hf_loader import load_hf_dir
from radixserve.model.registry import check_state_dict, load_model, load_tokenizer
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
from radixserve.server.metrics import ServerMetrics

TOL = 1e-4
NAME = "tiny-random-mamba-hybrid"
CFG = tiny_random_config("bamba")
BACKENDS = ("torch", "torch-eager")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------------------- transformers side
def hf_bamba_config(cfg: ModelConfig):
    """transformers' BambaConfig equivalent to our ModelConfig."""
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_layer_indices=[i for i, t in enumerate(cfg.layer_types) if t == "full"],
        mamba_n_heads=cfg.mamba_n_heads, mamba_d_head=cfg.mamba_head_dim, mamba_n_groups=cfg.mamba_n_groups,
        mamba_d_state=cfg.mamba_d_state, mamba_d_conv=cfg.mamba_d_conv,
        mamba_expand=cfg.mamba_inner // cfg.hidden_size, mamba_conv_bias=cfg.mamba_conv_bias,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """The tiny hybrid's weights in a folder transformers wrote (strict load: every name used)."""
    from transformers import BambaForCausalLM

    model = BambaForCausalLM(hf_bamba_config(CFG))
    missing, unexpected = model.load_state_dict(tiny_random_state_dict(0, CFG), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    path = tmp_path_factory.mktemp("bamba")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(hf_dir: str):
    from transformers import BambaForCausalLM

    return BambaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


# --------------------------------------------------------------------------- our side
def make_runner(backend: str = "torch", slots: int = 8) -> ModelRunner:
    return ModelRunner.from_config(CFG, tiny_random_state_dict(0, CFG), kv_capacity=2048, backend=backend,
                                   states=make_state_pool(CFG, slots))


class Seqs:
    """Sequences through the pools: each has KV slots for its whole length and a state slot."""

    def __init__(self, runner: ModelRunner, lengths: list[int]) -> None:
        self.runner = runner
        alloc = SlotAllocator(runner.kv_pool.capacity)
        self.kv = [alloc.alloc(n) for n in lengths]
        self.state = list(range(len(lengths)))
        for s in self.state:
            runner.model.states.zero(s)

    def run(self, parts: dict[int, tuple[int, list[int]]]) -> dict[int, torch.Tensor]:
        """One forward of ``{seq: (start, tokens)}``; all-position logits per sequence."""
        ids = list(parts)
        fb = ForwardBatch.build([parts[i][1] for i in ids], [parts[i][0] for i in ids],
                                [self.kv[i][: parts[i][0] + len(parts[i][1])] for i in ids],
                                return_all_logits=[True] * len(ids))
        fb.state_slots = [self.state[i] for i in ids]
        out = self.runner.forward(fb)
        return {i: out.all_logits[k].clone() for k, i in enumerate(ids)}

    def state_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.runner.model.states
        return st.conv[:, self.state[i]].clone(), st.ssm[:, self.state[i]].clone()


def test_registry_and_hf_folder(hf_dir: str) -> None:
    """The alias loads the seeded model (and its tokenizer, for an API process); transformers'
    folder loads to the same config and weights, every tensor where the model expects it."""
    tiny = load_model(NAME)
    assert tiny.config == CFG and tiny.name == NAME
    assert 0 < load_tokenizer(NAME).vocab_size <= CFG.vocab_size
    folder = load_hf_dir(hf_dir, with_tokenizer=False)
    assert folder.config == CFG
    check_state_dict(folder.config, folder.state_dict, hf_dir)
    assert set(folder.state_dict) == set(tiny.state_dict)
    for k, v in tiny.state_dict.items():
        assert torch.equal(folder.state_dict[k], v), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_batch_matches_transformers(hf_model, backend: str) -> None:
    """Prompts of mixed lengths in one ragged prefill: within 1e-4 of transformers at every
    position, and each row the same bits as the prompt alone."""
    runner = make_runner(backend)
    prompts = [_prompt(n, seed) for seed, n in enumerate((1, 5, 40, 100))]
    batch = Seqs(runner, [len(p) for p in prompts]).run({i: (0, p) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        ref = hf_logits(hf_model, p)
        assert (batch[i] - ref).abs().max().item() < TOL, (len(p), (batch[i] - ref).abs().max().item())
        alone = Seqs(runner, [len(p)]).run({0: (0, p)})[0]
        assert torch.equal(alone, batch[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_decode_are_exact(hf_model, backend: str) -> None:
    """One prompt as chunks then token by token: within 1e-4 of transformers, and (on the
    default backend, whose kernels keep one reduction order per row) the logits and the final
    state the same bits as one whole prefill. The eager backend is the reference path, which
    promises no bits across splits."""
    runner = make_runner(backend)
    p = _prompt(60, 7)
    whole = Seqs(runner, [len(p)])
    ref_bits = whole.run({0: (0, p)})[0]
    ref_state = whole.state_of(0)
    split = Seqs(runner, [len(p)])
    rows = []
    for a, b in ((0, 1), (1, 17), (17, 40)):
        rows.append(split.run({0: (a, p[a:b])})[0])
    for t in range(40, 60):
        rows.append(split.run({0: (t, p[t : t + 1])})[0])
    got = torch.cat(rows)
    assert (got - hf_logits(hf_model, p)).abs().max().item() < TOL
    if backend == "torch-eager":
        return
    assert torch.equal(got, ref_bits)
    conv, ssm = split.state_of(0)
    assert torch.equal(conv, ref_state[0]) and torch.equal(ssm, ref_state[1])


def test_mixed_batch_is_batch_invariant(hf_model) -> None:
    """A decode, a middle chunk and a fresh prefill in one forward: each row the bits it has alone."""
    runner = make_runner()
    a, b, c = _prompt(30, 1), _prompt(21, 2), _prompt(25, 3)
    together = Seqs(runner, [30, 21, 25])
    together.run({1: (0, b[:20]), 2: (0, c[:10])})
    mixed = together.run({0: (0, a), 1: (20, b[20:]), 2: (10, c[10:])})
    for i, (p, start) in enumerate(((a, 0), (b, 20), (c, 10))):
        alone = Seqs(runner, [len(p)])
        if start:
            alone.run({0: (0, p[:start])})
        assert torch.equal(alone.run({0: (start, p[start:])})[0], mixed[i]), i
        assert (mixed[i] - hf_logits(hf_model, p)[start:]).abs().max().item() < TOL


def test_greedy_tokens_match_transformers(hf_model) -> None:
    """The engine's greedy tokens (float32) are transformers' greedy tokens."""
    prompts = [_prompt(n, 20 + n) for n in (3, 17, 33)]
    with Engine(NAME, cache="none", dtype="float32", kv_cache_tokens=4096, max_running_requests=4) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = list(p)
        for _ in range(12):
            ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
        assert o.token_ids == ids[len(p):]


# --------------------------------------------------------------------------- the tree
def test_tree_snapshots_as_a_component() -> None:
    """A match ends at the deepest snapshot (the KV reaches further); a fork is a private copy;
    a snapshot below another on a linear path supersedes it; evicting snapshots keeps the
    nodes and their KV, evicting a node takes its snapshot; a reset frees every slot."""
    pool = make_state_pool(CFG, 6)
    freed: list[torch.Tensor] = []
    cache = MambaRadixCache(pool, max_snapshots=3, on_free=freed.append)
    ids = list(range(10, 30))
    assert cache.insert(ids, torch.arange(20)) == 0
    assert cache.match_prefix(ids).length == 0
    assert cache.kv_reach(ids) == 20 and cache.kv_reach(ids[:5] + [1, 2]) == 5
    src = pool.alloc()
    pool.zero(src)
    pool.ssm[:, src] = 1.5
    assert cache.snapshot(ids[:8], None, src)  # splits the edge there
    m = cache.match_prefix(ids)
    assert m.length == 8 and m.indices.tolist() == list(range(8))
    mine, other = pool.alloc(), pool.alloc()
    assert cache.fork_state(m.node, mine)
    pool.ssm[:, mine] += 1.0  # the request advances its own copy only
    assert cache.fork_state(cache.match_prefix(ids).node, other)
    assert torch.equal(pool.ssm[:, other], pool.ssm[:, src])
    assert not cache.fork_state(cache.match_prefix([7, 8, 9]).node, other)  # a miss: the zero state
    assert not pool.ssm[:, other].any() and not pool.conv[:, other].any()
    assert cache.snapshot(ids[:15], None, mine)
    assert cache.match_prefix(ids).length == 15
    cache.check_integrity()
    assert cache.evict_states(1) == 1  # the superseded one at 8 goes first
    assert cache.match_prefix(ids).length == 15 and cache.match_prefix(ids[:14]).length == 0
    assert cache.total_size == 20 and not freed
    assert not cache.snapshot(ids + [5], None, src)  # not in the tree: nothing kept
    cache.check_integrity()
    assert cache.evict(20) == 20 and len(cache.snapshots) == 0
    assert pool.available == 3  # src, mine and other are still their holders'
    cache.insert(ids, torch.arange(20, 40))
    assert cache.snapshot(ids[:4], None, src)
    cache.reset()
    assert pool.available == 3 and len(cache.snapshots) == 0
    cache.check_integrity()
    with pytest.raises(ValueError, match="page_size 1"):
        MambaRadixCache(pool, 3, page_size=4)


# --------------------------------------------------------------------------- the engine
def _poison_free_states(eng: Engine) -> None:
    pool = eng.core.states
    free = sorted(pool.free_slot_set())
    pool.conv[:, free] = float("nan")
    pool.ssm[:, free] = float("nan")


def _engine(cache: str, **kw) -> Engine:
    opts = {"dtype": "float32", "kv_cache_tokens": 4096, "max_running_requests": 6, "chunked_prefill_size": 64}
    opts.update(kw)
    return Engine(NAME, cache=cache, **opts)


def _drive(eng: Engine, prompts: list[list[int]], params: SamplingParams, group: int) -> list:
    """Run ``prompts`` a ``group`` at a time (1 = alone), poisoning free state slots before
    every step and checking every invariant after each group."""
    def poison() -> None:
        _poison_free_states(eng)

    eng.core.step_hooks.append(poison)
    outs = []
    try:
        for i in range(0, len(prompts), group):
            poison()
            outs += eng.generate(prompts[i : i + group], params)
            eng.check_integrity()
    finally:
        eng.core.step_hooks.remove(poison)
    return outs


def _conversations(eng: Engine, seed: int, params: SamplingParams, group: int, n: int = 6,
                   rounds: int = 3) -> list:
    """``n`` conversations behind two shared system prompts, ``rounds`` turns each: a turn's
    prompt is the previous turn's prompt and answer plus new tokens, the conversations of a
    round run ``group`` at a time (:func:`_drive`). The new tokens come from ``seed``, so
    two engines that answer alike see the same prompts."""
    rng = random.Random(seed)

    def tok(k: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(k)]

    systems = [tok(40), tok(40)]
    convs = [systems[i % 2] + tok(rng.randint(3, 20)) for i in range(n)]
    outs = []
    for _ in range(rounds):
        res = _drive(eng, convs, params, group)
        outs += res
        convs = [c + o.token_ids + tok(rng.randint(4, 12)) for c, o in zip(convs, res)]
    return outs


PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("group", [1, 4])
def test_cache_on_equals_off(group: int) -> None:
    """Tokens and logprobs (and top logprobs) with snapshots reused equal the no-cache run,
    alone and in batches; and the cache did serve prefixes."""
    with _engine("none") as off:
        want = _conversations(off, 3, PARAMS, group)
    with _engine("radix") as on:
        got = _conversations(on, 3, PARAMS, group)
        stats = on.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert [o.top_logprobs for o in got] == [o.top_logprobs for o in want]
    assert sum(o.cached_tokens for o in got) > 0
    assert stats["mamba_snapshot_hits"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_multi_turn_hits_each_turns_snapshot() -> None:
    """Each turn resumes at the end of the previous one: all its tokens but the last sampled one."""
    rng = random.Random(5)
    with _engine("radix") as eng:
        prompt = [rng.randrange(3, 500) for _ in range(30)]
        prev_written = 0
        for turn in range(4):
            out = eng.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
            assert out.cached_tokens == prev_written, turn
            eng.check_integrity()
            prev_written = len(prompt) + len(out.token_ids) - 1
            prompt = prompt + out.token_ids + [rng.randrange(3, 500) for _ in range(7)]
        stats = eng.stats()
    assert stats["mamba_snapshot_hits"] == 3 and stats["mamba_snapshot_tokens_saved"] > 0
    text = ServerMetrics().render(stats).decode()
    assert "radixserve_mamba_snapshot_hits_total 3.0" in text
    assert f"radixserve_mamba_snapshot_bytes {float(stats['mamba_snapshot_bytes'])}" in text


def test_shared_prefix_snapshot_at_the_branch_point() -> None:
    """The second request through a prefix computes it again but leaves a snapshot where it
    branches off; the third resumes there."""
    rng = random.Random(9)
    system = [rng.randrange(3, 500) for _ in range(48)]
    qs = [[rng.randrange(3, 500) for _ in range(10)] for _ in range(3)]
    qs[1][0] = qs[0][0] + 1 if qs[0][0] < 499 else 3  # they branch right after the system prompt
    qs[2][0] = qs[1][0] + 1 if qs[1][0] < 499 else 4
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with _engine("radix") as eng:
        first, second, third = (eng.generate(system + q, params)[0] for q in qs)
        eng.check_integrity()
    assert (first.cached_tokens, second.cached_tokens, third.cached_tokens) == (0, 0, len(system))


def _depth(node) -> int:
    n = 0
    while node.parent is not None:
        n += node.num_tokens
        node = node.parent
    return n


def test_interval_snapshots_in_a_long_prefill() -> None:
    """``mamba_snapshot_interval``: a long prompt seen once leaves snapshots at the multiples of
    the interval inside it (its chunks are cut there, whatever the chunk size), besides its
    end-of-request one; a later prompt sharing only part of it resumes at the deepest such
    multiple, where without the interval it would recompute everything; outputs equal the
    no-cache run."""
    rng = random.Random(31)
    long = [rng.randrange(3, 500) for _ in range(150)]
    other = long[:77] + [rng.randrange(3, 500) for _ in range(20)]  # parts at token 77
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=True)
    with _engine("none") as off:
        want = [off.generate(p, params)[0] for p in (long, other)]
    got = {}
    for interval in (0, 16):
        with _engine("radix", mamba_snapshot_interval=interval, chunked_prefill_size=40, mamba_snapshots=16) as on:
            first = on.generate(long, params)[0]
            depths = sorted(_depth(nd) for nd in on.core.cache.snapshots.slots)
            second = on.generate(other, params)[0]
            on.check_integrity()
            stats = on.stats()
        got[interval] = (first, second, depths, stats)
        assert [(o.token_ids, o.logprobs) for o in (first, second)] == [(o.token_ids, o.logprobs) for o in want]
    first, second, depths, stats = got[16]
    end = len(long) + len(first.token_ids) - 1
    assert depths == [16, 32, 48, 64, 80, 96, 112, 128, 144, end]
    assert (first.cached_tokens, second.cached_tokens) == (0, 64)
    assert stats["mamba_interval_snapshots_taken"] == 9 + 2  # and the second prompt's 80 and 96 (of its 97)
    assert stats["mamba_snapshot_tokens_saved"] == 64
    first, second, depths, stats = got[0]
    assert depths == [end] and second.cached_tokens == 0
    assert stats["mamba_interval_snapshots_taken"] == 0


@pytest.mark.parametrize("group", [1, 4])
def test_cache_on_equals_off_with_interval_snapshots(group: int) -> None:
    """Snapshots every 8 tokens, and the chunks cut at them, change no token or logprob."""
    with _engine("none") as off:
        want = _conversations(off, 19, PARAMS, group)
    with _engine("radix", mamba_snapshot_interval=8) as on:
        got = _conversations(on, 19, PARAMS, group)
        stats = on.stats()
    assert [(o.token_ids, o.logprobs, o.top_logprobs) for o in got] == \
        [(o.token_ids, o.logprobs, o.top_logprobs) for o in want]
    assert stats["mamba_interval_snapshots_taken"] > 0 and stats["mamba_snapshot_hits"] > 0


def test_snapshot_eviction_under_a_small_budget() -> None:
    """Two snapshots for many conversations: snapshots are evicted (the nodes and their KV
    stay), outputs still equal the no-cache run, and the budget is never exceeded."""
    with _engine("none") as off:
        want = _conversations(off, 11, PARAMS, 3, n=8)
    with _engine("radix", mamba_snapshots=2) as on:
        on.core.step_hooks.append(lambda: on.check_integrity())
        got = _conversations(on, 11, PARAMS, 3, n=8)
        stats = on.stats()
        cache = on.core.cache
        assert isinstance(cache, MambaRadixCache)
        assert len(cache.snapshots) <= 2 and cache.num_nodes > 2
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]
    assert stats["mamba_snapshots_evicted"] > 0
    assert stats["max_mamba_snapshots"] == 2


def test_latest_turn_outlives_earlier_turns() -> None:
    """Two snapshots for two interleaved conversations: each turn's snapshot supersedes its
    conversation's previous one, which goes first, so every turn still resumes where its
    conversation stopped (plain LRU would evict the other conversation's latest snapshot,
    whose stamp is older than the superseded one's last match)."""
    rng = random.Random(17)
    convs = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(2)]
    written = [0, 0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with _engine("radix", mamba_snapshots=2) as eng:
        for turn in range(3):
            for c in range(2):
                out = eng.generate(convs[c], params)[0]
                assert out.cached_tokens == written[c], (turn, c)
                eng.check_integrity()
                written[c] = len(convs[c]) + len(out.token_ids) - 1
                convs[c] = convs[c] + out.token_ids + [rng.randrange(3, 500) for _ in range(6)]
        assert eng.stats()["mamba_snapshots_evicted"] >= 4


def test_retraction_resumes_exactly() -> None:
    """A KV pool too small for every running request: requests are retracted and resume from
    the snapshot of where they stopped; outputs equal the no-cache run."""
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kw = {"kv_cache_tokens": 256, "max_running_requests": 6, "decode_reserve_ratio": 0.0}
    with _engine("none", **kw) as off:
        want = _drive(off, prompts, params, 6)
    with _engine("radix", **kw) as on:
        got = _drive(on, prompts, params, 6)
        stats = on.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["retractions"] > 0


def test_failed_step_leaves_snapshots_untouched() -> None:
    """A step that advanced its request's state and then failed: the request fails alone, no
    snapshot is taken from it, the snapshot it forked is unchanged (it advanced its own copy),
    and the retry resumes there and is exact."""
    rng = random.Random(23)
    first = [rng.randrange(3, 500) for _ in range(30)]
    tail = [rng.randrange(3, 500) for _ in range(9)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True)
    with _engine("none") as off:
        a = off.generate(first, params)[0]
        want = off.generate(first + a.token_ids + tail, params)[0]
    with _engine("radix") as on:
        assert on.generate(first, params)[0].token_ids == a.token_ids
        pool, snaps = on.core.states, on.core.cache.snapshots
        before = {nd: (pool.conv[:, s].clone(), pool.ssm[:, s].clone()) for nd, s in snaps.slots.items()}
        runner = on.core.runner
        real_run = type(runner).run

        def fail(self, batch, *args):
            real_run(self, batch, *args)  # the states are advanced, then the step fails
            raise RuntimeError("injected forward failure")

        runner.run = fail.__get__(runner)
        out = on.generate(first + a.token_ids + tail, params)[0]
        assert out.finish_reason == "error" and "injected" in (out.error or "")
        on.check_integrity()
        assert set(snaps.slots) == set(before)
        for nd, (conv, ssm) in before.items():
            assert torch.equal(pool.conv[:, snaps.slots[nd]], conv) and torch.equal(pool.ssm[:, snaps.slots[nd]], ssm)
        runner.run = real_run.__get__(runner)
        again = on.generate(first + a.token_ids + tail, params)[0]
        on.check_integrity()
    assert again.cached_tokens == len(first) + len(a.token_ids) - 1
    assert (again.token_ids, again.logprobs) == (want.token_ids, want.logprobs)


def test_integrity_sees_every_state_slot() -> None:
    """A leaked slot, a slot held twice and a waiting request holding one are each caught."""
    with _engine("radix") as eng:
        eng.generate([_prompt(20, 1), _prompt(30, 2)], SamplingParams(max_tokens=3, temperature=0))
        eng.check_integrity()
        pool, sched = eng.core.states, eng.core.scheduler
        leaked = pool.alloc()
        with pytest.raises(AssertionError, match="Mamba state slot leak"):
            eng.check_integrity()
        pool.free(leaked)
        eng.check_integrity()
        pool.free(leaked)  # freed twice
        with pytest.raises(AssertionError, match="free list twice"):
            eng.check_integrity()
        pool.alloc()
        eng.check_integrity()
        # A running request whose slot is also a snapshot's.
        rid = eng.add_request(_prompt(25, 3), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        eng.step()
        req = eng.core.requests[rid]
        own = req.state_slot
        req.state_slot = eng.core.cache.snapshot_slots()[0]
        with pytest.raises(AssertionError, match="held twice"):
            eng.check_integrity()
        req.state_slot = own
        eng.check_integrity()
        waiting = eng.add_request(_prompt(9, 4), SamplingParams(max_tokens=2))
        sched.waiting[-1].state_slot = own
        with pytest.raises(AssertionError, match="waiting request"):
            eng.check_integrity()
        sched.waiting[-1].state_slot = -1
        eng.abort(rid)
        eng.abort(waiting)
        eng.run_until_done()
        eng.check_integrity()


def test_engine_core_in_its_own_process() -> None:
    """``serve`` with the core in another process loads the tiny hybrid by name (and the API
    process its tokenizer); a conversation's second turn resumes at the first one's snapshot."""
    import httpx
    from server_utils import running_server

    cfg = EngineConfig(model=NAME, dtype="float32", kv_cache_tokens=4096, max_running_requests=4, num_threads=1)
    first = _prompt(30, 41)
    with running_server(engine=cfg) as (url, _):
        def gen(ids: list[int]) -> dict:
            r = httpx.post(url + "/generate", timeout=60, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            return r.json()

        a = gen(first)
        b = gen(first + a["output_ids"] + _prompt(6, 42))
    assert a["meta_info"]["cached_tokens"] == 0
    assert b["meta_info"]["cached_tokens"] == len(first) + len(a["output_ids"]) - 1
    with Engine(NAME, cache="none", dtype="float32", kv_cache_tokens=4096) as eng:
        want = eng.generate(first, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert a["output_ids"] == want.token_ids


# --------------------------------------------------------------------------- what it refuses
@pytest.mark.parametrize(("options", "flag"), [
    ({"hicache_l2_tokens": 4096}, "hicache_l2_tokens"),
    ({"tp_size": 2}, "tp_size"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"weight_dtype": "int8", "dtype": "bfloat16"}, "weight_dtype"),
    ({"cache": "table"}, "cache='table'"),
    ({"page_size": 4}, "page_size"),
])
def test_refuses_what_it_cannot_serve(options: dict, flag: str) -> None:
    """HiCache tiers, tensor parallelism, quantized KV and weights, the table cache and
    pages: a ValueError naming the option, before anything starts."""
    cfg = EngineConfig(**{"model": NAME, "dtype": "float32", "kv_cache_tokens": 4096, **options})
    with pytest.raises(ValueError, match=f"has Mamba layers; not supported with {flag}"):
        EngineCore(cfg)


def test_serves_speculative_decoding() -> None:
    """Speculative decoding is served (``tests/test_speculative_mamba.py`` checks its results):
    the state pool has no slots beyond the running requests' and the snapshots'."""
    cfg = EngineConfig(model=NAME, dtype="float32", kv_cache_tokens=4096, speculative="ngram-tree",
                       max_running_requests=8)
    core = EngineCore(cfg)
    try:
        assert core.scheduler.spec is not None
        assert core.states.capacity == 8 + 8
    finally:
        core.close()


def test_refuses_images() -> None:
    with _engine("radix") as eng, pytest.raises(ValueError, match="image"):
        eng.generate(_prompt(5, 1), SamplingParams(max_tokens=2), images=[b"\x89PNG\r\n\x1a\n"])


def test_config_and_state_pool_validation() -> None:
    with pytest.raises(ValueError, match="mamba_n_heads"):
        tiny_random_config("bamba", mamba_n_heads=0)
    with pytest.raises(ValueError, match="mamba_n_groups"):
        tiny_random_config("bamba", mamba_n_groups=3)
    with pytest.raises(ValueError, match="mamba_snapshots"):
        EngineConfig(model=NAME, mamba_snapshots=-1)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="mamba_snapshot_interval"):
            EngineConfig(model=NAME, mamba_snapshot_interval=bad)
    pool = make_state_pool(CFG, 2)
    with pytest.raises(ValueError, match="state slot"):
        pool.zero(2)
    per_layer = (CFG.mamba_d_conv - 1) * CFG.mamba_conv_dim + CFG.mamba_n_heads * CFG.mamba_head_dim * CFG.mamba_d_state
    assert pool.bytes_per_slot == len(CFG.mamba_layers) * 4 * per_layer


# --------------------------------------------------------------------------- tenants and grammars
def test_salts_keep_their_own_snapshots() -> None:
    """A conversation's snapshot serves its own cache salt (tenant) only: the same tokens under
    another salt start cold, and each salt's next turn resumes at its own snapshot."""
    first = _prompt(40, 61)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with _engine("radix") as eng:
        a = eng.generate(first, greedy, salt="tenant-a")[0]
        follow = first + a.token_ids + _prompt(6, 62)
        other = eng.generate(follow, greedy, salt="tenant-b")[0]
        own = eng.generate(follow, greedy, salt="tenant-a")[0]
        eng.check_integrity()
    assert a.cached_tokens == 0
    assert other.cached_tokens == 0, "a snapshot crossed a cache salt"
    assert own.cached_tokens == len(first) + len(a.token_ids) - 1
    assert other.token_ids == own.token_ids  # same tokens, same answer, cached or not


def test_grammar_requests_on_the_hybrid_match_no_cache() -> None:
    """Structured outputs on the hybrid: JSON-schema requests (seeded, sampled) beside free
    ones give valid JSON, and the same tokens and logprobs with the cache (second round on the
    first round's snapshots) as without it."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["x", "y"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    prompts = [_prompt(20 + 7 * i, 70 + i) for i in range(3)]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=5 + i, json_schema=schema, logprobs=True)
              for i in range(3)]
    free = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)]

    def rounds(cache: str) -> list[tuple[list[int], list[float]]]:
        with _engine(cache) as eng:
            outs = []
            for _ in range(2):
                got = eng.generate(prompts + prompts[:1], params + free)
                outs += [(o.token_ids, list(o.logprobs or [])) for o in got]
                for o in got[:3]:
                    jsonschema.validate(json.loads(o.text), schema)
            eng.check_integrity()
            if cache == "radix":  # the second round resumed at the first round's snapshots
                assert eng.stats()["mamba_snapshot_tokens_saved"] > 0
            return outs

    assert rounds("radix") == rounds("none")
