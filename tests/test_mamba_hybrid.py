"""Bamba (Mamba2 + attention) against transformers, and its recurrent state per sequence.

The tiny hybrid (``tiny-random-mamba-hybrid``: two Mamba2 layers to one attention layer, Mamba
heads in two groups, RoPE on half of each head) is saved as a Hugging Face folder by
transformers' ``BambaForCausalLM``, read back by our loader, and run through the KV pool and
the state pool: prefill, chunked prefill, decode and ragged batches, each within 1e-4 of
transformers' float32 logits, and bit for bit the same however the tokens were split into
steps or batched (the property that makes a cached state the state a request would compute).
"""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.runner import ModelRunner
from radixserve.memory.allocator import SlotAllocator
from radixserve.model.bamba import make_state_pool
from radixserve.model.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.hf_loader import load_hf_dir
from radixserve.model.registry import check_state_dict, load_model, load_tokenizer
from radixserve.model.tiny import tiny_random_config, tiny_random_state_dict

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
