"""Offline runners: every request of a round submitted at once to an in-process engine.

* :func:`run_offline` drives a radixserve :class:`~radixserve.engine.engine.Engine`;
* :func:`run_transformers` is the "no cross-request reuse" baseline: Hugging Face
  transformers ``LlamaForCausalLM`` (``Gemma3ForCausalLM`` for Gemma 3) loaded with the same
  weights, ``generate`` with batch 1, one request after another.

Times are ``time.monotonic`` seconds relative to the start of the run; the requests of a
round all arrive when the round starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixserve.bench.metrics import RequestRecord, RunResult
from radixserve.bench.workloads import BenchRequest, Workload, drive
from radixserve.sampling_params import SamplingParams

__all__ = ["run_offline", "run_transformers", "warm_up", "STAT_KEYS"]

STAT_KEYS = ("tree_seconds", "forward_seconds", "computed_prefill_tokens", "generated_tokens",
             "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "evicted_tokens",
             "retractions")

Progress = Callable[[int], Any] | None


def _params(r: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed,
                          ignore_eos=r.ignore_eos)


def warm_up(engine: Any) -> None:
    """One short request so lazy initialisation is not billed to the first run; then flush."""
    engine.generate(["Hello, how are you today?"], SamplingParams(max_tokens=2, temperature=0))
    engine.flush_cache()


def run_offline(engine: Any, workload: Workload, config: dict[str, Any] | None = None,
                progress: Progress = None, tag: str = "main",
                max_concurrency: int | None = None) -> RunResult:
    """Run ``workload`` round by round on ``engine``; each round is one offline batch (at
    most ``max_concurrency`` requests in the engine at once, the next added as one ends:
    the in-process counterpart of an online run with that many concurrent clients)."""
    before = {k: engine.stats().get(k, 0) for k in STAT_KEYS}
    records: list[RequestRecord] = []
    t0 = time.monotonic()
    cap = max_concurrency or 1 << 30

    def run_round(reqs: list[BenchRequest]) -> dict[str, str]:
        rid_of: dict[str, BenchRequest] = {}
        queue = list(reqs)
        done: dict[str, str] = {}
        while len(done) < len(reqs):
            while queue and len(rid_of) - len(done) < cap:
                r = queue.pop(0)
                rid_of[engine.add_request(r.prompt, _params(r))] = r
            for o in engine.step():
                if not o.finished or o.request_id not in rid_of:
                    continue
                r = rid_of[o.request_id]
                done[r.id] = o.text
                records.append(RequestRecord(
                    id=r.id, round=r.round, prompt_tokens=o.prompt_tokens,
                    cached_tokens=o.cached_tokens, completion_tokens=len(o.token_ids),
                    arrival=o.arrival_time - t0,
                    first_token=(o.first_token_time - t0) if o.first_token_time else None,
                    finish=(o.finish_time or time.monotonic()) - t0, text=o.text,
                    prompt_token_ids=list(o.prompt_token_ids or []), error=o.error,
                ))
                if progress is not None:
                    progress(1)
            if not engine.has_unfinished() and len(done) < len(rid_of) and not queue:
                raise RuntimeError("engine drained before every request finished")
        return done

    drive(workload, run_round)
    wall = time.monotonic() - t0
    after = engine.stats()
    stats = {k: after.get(k, 0) - before[k] for k in STAT_KEYS}
    cfg = {"mode": "offline", "engine": "radixserve", **(config or {})}
    return RunResult(workload.name, cfg, records, wall, stats, tag)


def _to_hf_config(cfg: Any) -> Any:
    """transformers' config equivalent to our ModelConfig (Llama, or Gemma 3's text model)."""
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.arch == "gemma3":
        from transformers import Gemma3TextConfig

        full = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        names = {"sliding": "sliding_attention", "full": "full_attention"}
        return Gemma3TextConfig(
            **common, hidden_activation=cfg.hidden_act,
            query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or cfg.head_dim),
            sliding_window=cfg.sliding_window, layer_types=[names[t] for t in cfg.layer_types],
            rope_parameters={"full_attention": full,
                             "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
            final_logit_softcapping=cfg.final_logit_softcapping,
        )
    from transformers import LlamaConfig

    if cfg.arch != "llama":
        raise ValueError(f"--engine transformers supports Llama and Gemma 3 models only, got {cfg.arch}")
    return LlamaConfig(**common, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, attention_bias=False)


def _no_init_weights() -> Any:
    """transformers' context that builds a model without initialising its weights."""
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:  # pragma: no cover - very old transformers
            from contextlib import nullcontext as no_init_weights
    return no_init_weights()


def load_transformers_model(loaded: Any) -> Any:
    """A transformers LlamaForCausalLM (Gemma3ForCausalLM for gemma3) carrying ``loaded``'s
    weights (our HF-named state dict)."""
    import torch

    if loaded.config.arch == "gemma3":
        from transformers import Gemma3ForCausalLM as model_cls
    else:
        from transformers import LlamaForCausalLM as model_cls

    with _no_init_weights():  # every parameter is overwritten below: skip the random init (~10 s)
        model = model_cls(_to_hf_config(loaded.config))
    sd = {k: v.to(torch.float32) for k, v in loaded.state_dict.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and loaded.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if loaded.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def run_transformers(loaded: Any, workload: Workload, model: Any = None,
                     progress: Progress = None, tag: str = "main") -> RunResult:
    """Batch-1 ``generate`` per request, sequentially: no KV reuse across requests."""
    model = model if model is not None else load_transformers_model(loaded)
    tok = loaded.tokenizer
    records: list[RequestRecord] = []
    t0 = time.monotonic()

    def run_round(reqs: list[BenchRequest]) -> dict[str, str]:
        arrival = time.monotonic()
        done: dict[str, str] = {}
        for r in reqs:
            ids, new, first = _generate_one(model, tok, r)
            text = done[r.id] = tok.decode(new)
            fin = time.monotonic()
            records.append(RequestRecord(
                id=r.id, round=r.round, prompt_tokens=len(ids), cached_tokens=0, completion_tokens=len(new),
                arrival=arrival - t0, first_token=(first or fin) - t0, finish=fin - t0, text=text,
                prompt_token_ids=ids,
            ))
            if progress is not None:
                progress(1)
        return done

    drive(workload, run_round)
    wall = time.monotonic() - t0
    cfg = {"mode": "offline", "engine": "transformers", "cache": "none", "policy": "fcfs"}
    return RunResult(workload.name, cfg, records, wall, {}, tag)


def _generate_one(model: Any, tok: Any, r: Any) -> tuple[list[int], list[int], float | None]:
    """One request through Transformers' ``generate`` (batch 1): the prompt's ids, the new
    ids, and when the first new token came (None: no token)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class _FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.t: float | None = None

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2 and self.t is None:  # first put() is the prompt
                self.t = time.monotonic()

        def end(self) -> None:
            pass

    ids = tok.encode_prompt(r.prompt)  # the ids the engine sees
    st = _FirstToken()
    kw: dict[str, Any] = {"max_new_tokens": r.max_tokens, "streamer": st, "pad_token_id": tok.eos_token_id or 0}
    if r.temperature > 0:
        torch.manual_seed(r.seed or 0)
        kw.update(do_sample=True, temperature=r.temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    if r.ignore_eos:
        kw["min_new_tokens"] = r.max_tokens
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), **kw)
    return ids, out[0, len(ids):].tolist(), st.t
