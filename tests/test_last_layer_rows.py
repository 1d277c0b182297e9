"""The last decoder layer past its attention runs on the rows whose logits are returned only
(``LogitRows``, ``last_layer_rows_only``): those rows must come out bit for bit as a full last
layer gives them, and every row's K/V must still reach the pool (a later step reads them)."""

from __future__ import annotations

import pytest
import torch

from cpu_paths import require_isa, require_kernels
from helpers_model import shuffled_allocator
from radixserve.engine.runner import ModelRunner
from radixserve.kernels.isa import ISAS
from radixserve.kernels.library import Kernels
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.arch.logits import LogitRows
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict

LENGTHS = (1, 9, 40, 17, 5)
# Per sequence: (need_logits, return_all_logits). The third needs none (a chunk of a chunked
# prefill), the second wants every row (prompt logprobs).
FLAGS = [(True, False), (True, True), (False, False), (True, False), (True, False)]


def _prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_then_decode(runner: ModelRunner, flags: list[tuple[bool, bool]]) -> list[torch.Tensor]:
    """One ragged prefill with ``flags``, then one decode step of every sequence (which reads
    every prompt row's K/V in every layer): the tensors both return, in a fixed order."""
    alloc = shuffled_allocator(runner.kv_pool.capacity, seed=5)
    prompts = [_prompt(n, 30 + n) for n in LENGTHS]
    slots = [alloc.alloc(n + 1) for n in LENGTHS]
    batch = ForwardBatch.build(prompts, [0] * len(prompts), [s[:n] for s, n in zip(slots, LENGTHS)],
                               return_all_logits=[a for _, a in flags], need_logits=[nd for nd, _ in flags])
    out = runner.forward(batch)
    got = [out.next_token_logits.clone(), torch.tensor(out.logits_seqs)]
    got += [t.clone() for t in out.all_logits if t is not None]
    step = ForwardBatch.build([[7 + i] for i in range(len(prompts))], list(LENGTHS), slots)
    got.append(runner.forward(step).next_token_logits.clone())
    for s in slots:
        alloc.free(s)
    return got


def assert_switch_keeps_the_bits(runner: ModelRunner, switch: str, monkeypatch) -> None:  # noqa: ANN001
    """``_prefill_then_decode`` with the model class's ``switch`` on and off, in one C++ call and
    from Python (in that order, on then off): every output tensor the same bits."""
    outs = {}
    for one in (True, False):
        monkeypatch.setattr(LlamaForCausalLM, "one_call_layers", one)
        for on in (True, False):
            monkeypatch.setattr(LlamaForCausalLM, switch, on)
            outs[one, on] = _prefill_then_decode(runner, FLAGS)
    ref = outs[False, False]
    for key, got in outs.items():
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), (switch, key)


def _runner(arch: str, isa: str, dtype: torch.dtype, kv: str | None) -> ModelRunner:
    config = tiny_random_config(arch)
    sd = {k: v.to(dtype) for k, v in tiny_random_state_dict(seed=0, config=config).items()}
    return ModelRunner.from_config(config, sd, kv_capacity=512, dtype=dtype, cpu_isa=isa,
                                   linear_backend="radixserve", kv_dtype=kv)


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_last_layer_on_the_logit_rows_gives_the_full_layers_bits(isa, dtype, arch, kv, monkeypatch):
    """In one C++ call and from Python, at every level: the same logits (next-token and every
    row of the sequence that asked for them) and the same next step as a full last layer, and
    the one call is handed the rows (so the pruned path is the one measured)."""
    require_kernels()
    require_isa(isa)
    runner = _runner(arch, isa, dtype, kv)
    name = "gemma3_layers" if arch == "gemma3" else "llama_layers"
    tails: list[torch.Tensor | None] = []
    one_call = getattr(Kernels, name)
    monkeypatch.setattr(Kernels, name, lambda self, *a, **kw: tails.append(a[6]) or one_call(self, *a, **kw))
    assert_switch_keeps_the_bits(runner, "last_layer_rows_only", monkeypatch)
    # The one call's prefills: pruned (the rows of LogitRows), then full (None); decodes: None.
    ends = torch.tensor(LENGTHS).cumsum(0)
    want = [int(ends[0]) - 1, *range(int(ends[0]), int(ends[1])), int(ends[3]) - 1, int(ends[4]) - 1]
    assert tails[0] is not None and tails[0].tolist() == want
    assert tails[1:] == [None, None, None]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_chunk_that_needs_no_logits_still_fills_the_pool(arch, monkeypatch):
    """Every sequence's need_logits False (an intermediate chunk): no row passes the last
    attention, no logits come back, and the next step reads the same K/V as after a full pass."""
    require_kernels()
    runner = _runner(arch, "avx512" if "avx512" in ISAS else ISAS[-1], torch.bfloat16, None)
    none = [(False, False)] * len(LENGTHS)
    outs = {}
    for pruned in (True, False):
        monkeypatch.setattr(LlamaForCausalLM, "last_layer_rows_only", pruned)
        outs[pruned] = _prefill_then_decode(runner, none)
    assert outs[True][0].shape[0] == 0 and outs[True][1].numel() == 0
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


def test_logit_rows_plan():
    """The plan against a direct reading of the flags: the rows in step order, which of them
    are next-token rows, and no selection where every row is needed in order."""
    slots = [torch.arange(n) for n in (3, 1, 4)]
    b = ForwardBatch.build([[1] * 3, [2], [3] * 4], [0, 0, 0], slots,
                           return_all_logits=[False, False, True], need_logits=[True, False, True])
    plan = LogitRows(b, 8, torch.device("cpu"))
    assert plan.rows.tolist() == [2, 4, 5, 6, 7] and plan.seqs == [0, 2] and plan.count == 5
    assert plan.spans == [None, None, (1, 5)]
    head = lambda h: h.float() * 2  # noqa: E731
    hidden = torch.arange(8, dtype=torch.float32).unsqueeze(1)
    out = plan.logits(hidden, head, 1)
    assert out.next_token_logits.flatten().tolist() == [4.0, 14.0]
    assert out.all_logits[2].flatten().tolist() == [8.0, 10.0, 12.0, 14.0]
    # the layers may hand back the selected rows already: the same result
    assert torch.equal(plan.logits(hidden[plan.rows], head, 1).next_token_logits, out.next_token_logits)
    decode = ForwardBatch.build([[1], [2]], [0, 0], [torch.arange(1), torch.arange(1)])
    assert LogitRows(decode, 2, torch.device("cpu")).rows is None
    with pytest.raises(ValueError, match="return_all_logits"):
        LogitRows(ForwardBatch.build([[1]], [0], [torch.arange(1)], return_all_logits=[True],
                                     need_logits=[False]), 1, torch.device("cpu"))
