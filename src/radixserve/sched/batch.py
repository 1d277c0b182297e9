"""What the scheduler hands to the model runner and gets back, and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from radixserve.request import Req


@dataclass
class ScheduledBatch:
    """What one step runs. The first ``num_decode`` requests decode one token each; the
    rest compute a prompt chunk (``extend_lens[i]`` tokens from position ``starts[i]``).
    ``drafts[i]`` (speculative decoding, empty or absent: none): tokens a decoding request
    proposes after its last one. Its row then computes that token and the draft as one
    extend (the draft is the last ``len(drafts[i])`` of its ``extend_lens[i]`` positions,
    with slots taken for them), and the sampler verifies the draft position by position."""

    reqs: list[Req]
    extend_lens: list[int]
    starts: list[int]
    sample: list[bool]  # a token is sampled for this request after this pass
    want_all_logits: list[bool]  # logits of every new position (prompt logprobs)
    num_decode: int = 0
    drafts: list[list[int]] = field(default_factory=list)

    def draft(self, i: int) -> list[int]:
        """The draft of row ``i`` (empty when it has none)."""
        return self.drafts[i] if self.drafts else []


class SchedulerOutput(NamedTuple):
    batch: ScheduledBatch | None
    failed: list[Req]  # requests that ended while scheduling (e.g. can never fit)


class SampledRow(NamedTuple):
    """The sampler's verdict for one request of a batch (see ``runner.StepResult``)."""

    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    error: str | None


@dataclass
class SchedulerStats:
    prefix_query_tokens: int = 0  # prompt tokens looked up in the cache at first admission
    prefix_hit_tokens: int = 0  # of those, tokens served from the cache
    image_query_tokens: int = 0  # of the looked-up tokens, image positions
    image_hit_tokens: int = 0  # of those, served from the cache
    computed_prefill_tokens: int = 0  # tokens run through prefill (chunks, recomputation)
    generated_tokens: int = 0
    forced_tokens: int = 0  # of those, appended by a grammar's fast-forward (no decode step)
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_draft_tokens: int = 0  # of those, accepted (appended without a step of their own)
    verified_rows: int = 0  # decode rows that verified a draft (each also samples one token)
    retractions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0
    failed_steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    max_wait_seconds: float = 0.0  # longest time a request waited for its first admission
    tree_seconds: float = 0.0  # time spent in prefix-cache operations
    finish_reasons: dict[str, int] = field(default_factory=dict)
