"""Reusable comparison helpers: our paged model vs a transformers reference on the same weights.

Used by the tiny-model tests here and by the real-model (SmolLM2) tests, so everything takes a
``ModelConfig`` + Hugging Face-named state dict or a :class:`ModelRunner` and plain token lists.
"""

from __future__ import annotations

from typing import Mapping

import torch

from radixserve.engine.runner import ModelRunner
from radixserve.memory.allocator import SlotAllocator
from radixserve.model.model_config import ModelConfig
from radixserve.model.arch.forward_batch import ForwardBatch


# --------------------------------------------------------------------------- reference (HF)
def hf_config(config: ModelConfig):
    """A transformers LlamaConfig / Qwen2Config equivalent to our ModelConfig."""
    from transformers import LlamaConfig, Qwen2Config

    rope: dict = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = dict(config.rope_scaling)
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = config.rope_theta
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
    )
    if config.arch == "qwen2":
        cfg = Qwen2Config(**common)
        if cfg.hidden_size // cfg.num_attention_heads != config.head_dim:
            raise ValueError("Qwen2Config derives head_dim from hidden_size / num_heads")
    else:
        cfg = LlamaConfig(**common, head_dim=config.head_dim, attention_bias=config.attention_bias)
    return cfg


def build_hf_model(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
):
    """transformers LlamaForCausalLM / Qwen2ForCausalLM holding exactly our weights."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cfg = hf_config(config)
    cfg._attn_implementation = attn_implementation
    cls = Qwen2ForCausalLM if config.arch == "qwen2" else LlamaForCausalLM
    model = cls(cfg)
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"HF load mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


@torch.inference_mode()
def reference_logits_hf(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    token_ids: list[int],
    model=None,
) -> torch.Tensor:
    """All-position float32 logits ``[len(token_ids), vocab]`` from transformers (eager)."""
    model = model or build_hf_model(config, state_dict)
    ids = torch.tensor([token_ids], dtype=torch.int64)
    return model(input_ids=ids).logits[0].float()


# --------------------------------------------------------------------------- our model
def shuffled_allocator(capacity: int, seed: int = 0) -> SlotAllocator:
    """A real SlotAllocator whose free list is a random permutation: slots come out scattered."""
    alloc = SlotAllocator(capacity)
    gen = torch.Generator().manual_seed(seed)
    # Set the free list directly: freeing pages back would get them merged in sorted order
    # (the allocator keeps slots in ascending runs on purpose), which is not what we want here.
    alloc._free_pages = torch.randperm(capacity, generator=gen)
    return alloc


def churned_allocator(capacity: int, seed: int = 0, steps: int = 3000, max_running: int = 32,
                      max_len: int = 1500) -> SlotAllocator:
    """A real SlotAllocator after ``steps`` scheduler-like steps: requests of random length
    arrive (one prompt allocation each), every running request takes one decode slot per
    step, and requests finish in random order (freeing everything they held). The requests
    still running at the end keep their slots, as in a busy server."""
    import random

    rng = random.Random(seed)
    alloc = SlotAllocator(capacity)
    running: list[list[torch.Tensor]] = []
    for _ in range(steps):
        while len(running) < max_running and rng.random() < 0.5:
            s = alloc.alloc(rng.randint(20, max_len))
            if s is None:
                break
            running.append([s])
        if running and (d := alloc.alloc(len(running))) is not None:
            for i, r in enumerate(running):
                r.append(d[i : i + 1])
        keep = []
        for r in running:
            if rng.random() < 0.01:
                alloc.free(torch.cat(r))
            else:
                keep.append(r)
        running = keep
    return alloc


def _alloc(allocator: SlotAllocator, n: int) -> torch.Tensor:
    slots = allocator.alloc(n)
    if slots is None:
        raise ValueError(f"allocator has {allocator.available} free slots, need {n}")
    return slots[:n]


def pool_logits_prefill(
    runner: ModelRunner,
    prompts: list[list[int]],
    allocator: SlotAllocator | None = None,
) -> list[torch.Tensor]:
    """All prompts in ONE ragged prefill batch; all-position logits per prompt."""
    allocator = allocator or SlotAllocator(runner.kv_pool.capacity)
    slots = [_alloc(allocator, len(p)) for p in prompts]
    batch = ForwardBatch.build(
        prompts, [0] * len(prompts), slots, return_all_logits=[True] * len(prompts),
        device=runner.device,
    )
    out = runner.forward(batch)
    for s in slots:
        allocator.free(s)
    return [t.clone() for t in out.all_logits]  # type: ignore[union-attr]


def pool_logits_decode(
    runner: ModelRunner,
    prompts: list[list[int]],
    allocator: SlotAllocator | None = None,
) -> list[torch.Tensor]:
    """Feed every prompt token by token, all live sequences decoded together per step.

    Step ``s`` runs token ``s`` of each prompt that is longer than ``s`` in one batched
    decode, so sequences of different lengths share batches. Returns ``[len, vocab]`` each.
    """
    allocator = allocator or SlotAllocator(runner.kv_pool.capacity)
    slots = [_alloc(allocator, len(p)) for p in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(max(len(p) for p in prompts)):
        live = [i for i, p in enumerate(prompts) if len(p) > step]
        batch = ForwardBatch.build(
            [[prompts[i][step]] for i in live], [step] * len(live),
            [slots[i][: step + 1] for i in live], device=runner.device,
        )
        out = runner.forward(batch)
        for r, i in enumerate(live):
            rows[i].append(out.next_token_logits[r].clone())
    for s in slots:
        allocator.free(s)
    return [torch.stack(r) for r in rows]


def greedy_generate(
    runner: ModelRunner,
    prompt: list[int],
    max_new_tokens: int,
    allocator: SlotAllocator | None = None,
    prefix_split: int | None = None,
) -> list[int]:
    """Greedy tokens through the pool; ``prefix_split`` prefills the prompt in two passes."""
    allocator = allocator or SlotAllocator(runner.kv_pool.capacity)
    total = len(prompt) + max_new_tokens
    slots = _alloc(allocator, total)
    parts = [prompt] if not prefix_split else [prompt[:prefix_split], prompt[prefix_split:]]
    done = 0
    for part in parts:
        batch = ForwardBatch.build([part], [done], [slots[: done + len(part)]], device=runner.device)
        logits = runner.forward(batch).next_token_logits
        done += len(part)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(logits[0].argmax())
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        batch = ForwardBatch.build([[tok]], [done], [slots[: done + 1]], device=runner.device)
        logits = runner.forward(batch).next_token_logits
        done += 1
    allocator.free(slots)
    return out
