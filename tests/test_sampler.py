"""SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.engine.sampler import Sampler, apply_top_k_top_p_min_p
from radixserve.sampling_params import SamplingParams

V = 32


def _sampler(vocab: int = V) -> Sampler:
    return Sampler(vocab, "cpu")


def _logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def _sample(s: Sampler, logits: torch.Tensor, params: list[SamplingParams],
            gens: list[torch.Generator | None] | None = None,
            output_ids: list[list[int]] | None = None,
            prompt_ids: list[list[int]] | None = None):
    b = logits.shape[0]
    return s.sample(
        logits, params,
        output_ids if output_ids is not None else [[] for _ in range(b)],
        prompt_ids if prompt_ids is not None else [[] for _ in range(b)],
        gens if gens is not None else [None] * b,
    )


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("stop", [1]),
        ("stop", ["ok", None]),
        ("stop", [""]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["3"]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 3),
        ("seed", "42"),
        ("logprob_start_len", -2),
        ("logprobs", 1),
        ("ignore_eos", "yes"),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert p.max_tokens == 128 and p.temperature == 1.0 and p.stop == []
    assert p.stop_token_ids == [] and not p.is_greedy and not p.has_penalties
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert SamplingParams(max_tokens=0).max_tokens == 0
    p = SamplingParams(temperature=1, top_p=1, frequency_penalty=-2, presence_penalty=2)
    assert isinstance(p.temperature, float) and p.has_penalties
    assert SamplingParams(top_k=0).top_k == 0  # 0 = off, accepted


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


def test_prompt_logprob_start() -> None:
    assert SamplingParams().prompt_logprob_start is None
    assert SamplingParams(prompt_logprobs=True).prompt_logprob_start == 0
    assert SamplingParams(logprob_start_len=5).prompt_logprob_start == 5


# ---------------------------------------------------------------- greedy & filters


def test_greedy_is_argmax_and_does_not_modify_input() -> None:
    logits = _logits(8)
    before = logits.clone()
    out = _sample(_sampler(), logits, [SamplingParams(temperature=0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(logits, before)


def test_greedy_consumes_no_randomness() -> None:
    logits = _logits(4)
    s = _sampler()
    g = s.make_generator(3)
    state = g.get_state()
    _sample(s, logits, [SamplingParams(temperature=0)] * 4, [g] * 4)
    assert torch.equal(g.get_state(), state)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
def test_top_k_1_equals_greedy(temperature: float) -> None:
    logits = _logits(16, seed=1)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 16
    assert _sample(_sampler(), logits, params).token_ids == logits.argmax(-1).tolist()
    # Also via the filter itself, without the greedy shortcut.
    filt = apply_top_k_top_p_min_p(logits, torch.ones(16, dtype=torch.long), None, None)
    assert (torch.isfinite(filt).sum(-1) == 1).all()
    assert filt.argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_k() -> None:
    logits = _logits(3, seed=2)
    k = torch.tensor([1, 5, 0])
    filt = apply_top_k_top_p_min_p(logits, k, None, None)
    assert torch.isfinite(filt).sum(-1).tolist() == [1, 5, V]
    kept = torch.isfinite(filt[1]).nonzero().flatten().tolist()
    assert sorted(kept) == sorted(logits[1].topk(5).indices.tolist())


def test_top_p_tiny_keeps_only_max() -> None:
    logits = _logits(6, seed=3)
    s = _sampler()
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 6
    for seed in range(20):
        out = _sample(s, logits, params, [s.make_generator(seed)] * 6)
        assert out.token_ids == logits.argmax(-1).tolist()


def _ref_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_reference(p: float) -> None:
    logits = _logits(4, seed=4)
    filt = apply_top_k_top_p_min_p(logits, None, torch.full((4,), p), None)
    for r in range(4):
        kept = set(torch.isfinite(filt[r]).nonzero().flatten().tolist())
        assert kept == _ref_top_p(logits[r], p)
        # surviving logits are unchanged
        assert torch.equal(filt[r][list(kept)], logits[r][list(kept)])


def test_top_p_one_keeps_everything_even_tiny_probs() -> None:
    logits = torch.zeros(2, V)
    logits[:, 0] = 60.0  # others have prob ~1e-26: cumsum hits 1.0 early in float32
    filt = apply_top_k_top_p_min_p(logits, None, torch.tensor([1.0, 0.5]), None)
    assert torch.isfinite(filt[0]).all()
    assert torch.isfinite(filt[1]).sum() == 1


def test_min_p_filtering() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    filt = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.15]))
    # threshold = 0.15 * 0.5 = 0.075
    assert torch.isfinite(filt[0]).tolist() == [True, True, True, False, False]
    none = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.0]))
    assert torch.isfinite(none).all()
    # and through sample(): filtered tokens are never drawn
    s = Sampler(5)
    g = s.make_generator(0)
    params = [SamplingParams(min_p=0.15)] * 500
    got = set(_sample(s, logits.expand(500, 5), params, [g] * 500).token_ids)
    assert got <= {0, 1, 2} and len(got) == 3


# ---------------------------------------------------------------- randomness


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    logits = torch.zeros(1, V)  # uniform: maximally random
    s = _sampler()

    def draws(seed: int) -> list[int]:
        g = s.make_generator(seed)
        return [_sample(s, logits, [SamplingParams()], [g]).token_ids[0] for _ in range(50)]

    assert draws(123) == draws(123)
    assert draws(123) != draws(124)  # P(equal) = 32**-50


def test_seeded_row_independent_of_batch() -> None:
    s = _sampler()
    logits = _logits(5, seed=5)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=20)
    alone = _sample(s, logits[2:3], [p], [s.make_generator(7)]).token_ids[0]
    mixed_params = [SamplingParams(temperature=0), SamplingParams(), p,
                    SamplingParams(top_k=3), SamplingParams(min_p=0.2)]
    gens = [None, s.make_generator(1), s.make_generator(7), None, s.make_generator(9)]
    assert _sample(s, logits, mixed_params, gens).token_ids[2] == alone


def test_make_generator_none_for_no_seed() -> None:
    assert _sampler().make_generator(None) is None


@pytest.mark.parametrize("temperature, top_k", [(1.0, -1), (0.6, -1), (2.0, 3)])
def test_frequencies_match_softmax(temperature: float, top_k: int) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    s = Sampler(6)
    n = 20000
    g = s.make_generator(2024)  # seeded: the test is deterministic, cannot flake
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * n
    ids = _sample(s, logits.expand(n, 6), params, [g] * n).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=6).double() / n
    scaled = logits[0].double() / temperature
    if top_k > 0:
        cut = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < cut, -math.inf)
    expected = torch.softmax(scaled, -1)
    # ~5 standard errors at most (sqrt(0.25 / 20000) ~ 0.0035)
    assert (freq - expected).abs().max().item() < 0.02
    # chi-square over cells with expected mass; 5 d.o.f. 99.99% quantile ~ 25.7
    mask = expected > 0
    chi2 = (((freq - expected) ** 2 / expected)[mask]).sum().item() * n
    assert chi2 < 30
    assert (freq[~mask] == 0).all()


def test_unseeded_rows_use_global_rng() -> None:
    logits = torch.zeros(64, V)
    torch.manual_seed(0)
    a = _sample(_sampler(), logits, [SamplingParams()] * 64).token_ids
    torch.manual_seed(0)
    b = _sample(_sampler(), logits, [SamplingParams()] * 64).token_ids
    assert a == b and len(set(a)) > 10


# ---------------------------------------------------------------- penalties


def _ref_penalties(logits: torch.Tensor, params: list[SamplingParams],
                   output_ids: list[list[int]], prompt_ids: list[list[int]]) -> torch.Tensor:
    out = logits.clone()
    for r, p in enumerate(params):
        for t in set(prompt_ids[r]) | set(output_ids[r]):
            x = out[r, t].item()
            out[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output_ids[r]):
            c = output_ids[r].count(t)
            out[r, t] -= c * p.frequency_penalty + p.presence_penalty
    return out


def test_penalties_match_reference() -> None:
    logits = _logits(4, seed=6)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5),
        SamplingParams(),
    ]
    output_ids = [[1, 2, 2, 5], [3, 3, 3, 7, 0], [4, 4, 9], [1, 1, 1]]
    prompt_ids = [[0, 6, 6], [8, 9], [10, 4], [2]]
    got = _sampler().apply_penalties(logits, params, output_ids, prompt_ids)
    want = _ref_penalties(logits, params, output_ids, prompt_ids)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3], logits[3])  # no penalty → untouched
    # frequency/presence ignore prompt tokens
    assert got[1, 8] == logits[1, 8]


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    s = Sampler(4)
    greedy = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert _sample(s, logits, [greedy], output_ids=[[0]]).token_ids == [1]
    assert _sample(s, logits, [SamplingParams(temperature=0)], output_ids=[[0]]).token_ids == [0]
    pres = SamplingParams(temperature=0, presence_penalty=0.5)
    assert _sample(s, logits, [pres], output_ids=[[0]]).token_ids == [1]
    # prompt tokens count for repetition penalty only
    assert _sample(s, logits, [greedy], prompt_ids=[[0]]).token_ids == [1]
    assert _sample(s, logits, [pres], prompt_ids=[[0]]).token_ids == [0]


def test_no_penalties_returns_same_tensor() -> None:
    logits = _logits(2)
    got = _sampler().apply_penalties(logits, [SamplingParams()] * 2, [[1], [2]], [[3], [4]])
    assert got is logits


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_top_sorted() -> None:
    logits = _logits(3, seed=8)
    s = _sampler()
    params = [
        SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=True),
        SamplingParams(temperature=2.0, top_logprobs=20),
    ]
    out = _sample(s, logits, params, [s.make_generator(i) for i in range(3)],
                  output_ids=[[0], [1], [2]])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for r, t in enumerate(out.token_ids):
        assert out.logprobs[r] == pytest.approx(ref[r, t].item(), abs=1e-6)
    assert [len(x) for x in out.top_logprobs] == [5, 0, 20]
    for r, row in enumerate(out.top_logprobs):
        vals = [v for _, v in row]
        assert vals == sorted(vals, reverse=True)
        for tid, v in row:
            assert v == pytest.approx(ref[r, tid].item(), abs=1e-6)
    assert out.top_logprobs[0][0][0] == logits[0].argmax().item()


def test_logprobs_of_prompt_tokens() -> None:
    logits = _logits(6, seed=9)
    ids = [3, 1, 4, 1, 5, 9]
    res = _sampler().logprobs_of(logits, ids, top_k=4)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(res.chosen, ref[torch.arange(6), torch.tensor(ids)])
    assert res.top_ids.shape == (6, 4) and res.top_logprobs.shape == (6, 4)
    assert (res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(res.top_logprobs, ref.gather(1, res.top_ids))
    none = _sampler().logprobs_of(logits, torch.tensor(ids))
    assert none.top_ids.shape == (6, 0)
    with pytest.raises(ValueError):
        _sampler().logprobs_of(logits, ids[:3])


def test_padded_vocab_never_sampled() -> None:
    logits = torch.zeros(200, V + 8)
    logits[:, V:] = 100.0  # padding columns would win if not masked
    s = _sampler(V)
    g = s.make_generator(0)
    out = _sample(s, logits, [SamplingParams(logprobs=True)] * 200, [g] * 200)
    assert max(out.token_ids) < V
    assert out.logprobs[0] == pytest.approx(-math.log(V), abs=1e-5)
    assert _sample(s, logits[:1], [SamplingParams(temperature=0)]).token_ids[0] < V


def test_batch_size_mismatch_and_empty() -> None:
    s = _sampler()
    with pytest.raises(ValueError, match="params"):
        s.sample(_logits(2), [SamplingParams()], [[], []], [[], []], [None, None])
    assert s.sample(torch.zeros(0, V), [], [], [], []).token_ids == []
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0)


def test_frequencies_match_softmax_at_gemma3_vocabulary() -> None:
    """The inverse-CDF draw at 262,144 tokens: three tokens hold 0.9 of the mass and the
    rest share 0.1 (each ~4e-7), so the running sum must keep the long tail its share."""
    vocab, n, rows = 262_144, 2000, 100  # 100 rows a call: a call's float64 sums are 200 MiB
    probs = torch.full((vocab,), 0.1 / (vocab - 3), dtype=torch.float64)
    probs[[7, 100_000, vocab - 1]] = 0.3
    logits = probs.log().float().unsqueeze(0).expand(rows, vocab)
    s = Sampler(vocab)
    g = s.make_generator(11)
    ids = torch.tensor([t for _ in range(n // rows)
                        for t in _sample(s, logits, [SamplingParams()] * rows, [g] * rows).token_ids])
    heads = [(ids == t).double().mean().item() for t in (7, 100_000, vocab - 1)]
    tail = 1 - sum(heads)
    assert all(abs(h - 0.3) < 0.04 for h in heads), heads  # ~4 standard errors (0.0102)
    assert abs(tail - 0.1) < 0.027, tail  # ~4 standard errors (0.0067)
    assert ((ids >= 0) & (ids < vocab)).all()


def test_draw_across_blocks_never_picks_zero_probability() -> None:
    """Mass on both sides of a block edge and in the partial last block; every other token
    is -inf, so a draw that lands on a block's end must step back, never onto a zero."""
    vocab, n = 2100, 3000
    logits = torch.full((1, vocab), -math.inf)
    live = {1023: 0.5, 1024: 0.25, 2099: 0.25}
    for t, p in live.items():
        logits[0, t] = math.log(p)
    s = Sampler(vocab)
    g = s.make_generator(3)
    ids = torch.tensor(_sample(s, logits.expand(n, vocab), [SamplingParams()] * n, [g] * n).token_ids)
    assert set(ids.tolist()) == set(live)
    for t, p in live.items():
        assert abs((ids == t).double().mean().item() - p) < 0.04  # ~4 standard errors
