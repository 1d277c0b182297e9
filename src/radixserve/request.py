"""Requests as the scheduler and engine core see them, and what callers get back.

``Req`` lives in the engine core and holds token ids only (no text: detokenization and stop
strings belong to whoever talks to the user). ``RequestOutput`` is what a caller of
``Engine`` (or a client of the engine-core process) receives after each step: the delta of
that step, plus the cumulative result once the request has finished.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.images import ImageInput, ImageSpan, span_keys
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.cache.base import CacheHandle, PrefetchTicket
    from radixserve.grammar.matcher import GrammarState

_EMPTY = torch.empty(0, dtype=torch.int64)


class SpecCounters(Protocol):
    """What the engine reads of a request's speculation state (``sched/speculation.py``'s
    ``DraftState``, which only the speculator builds and changes)."""

    drafted: int  # draft tokens verified
    accepted: int  # of those, accepted


@dataclass(eq=False)
class ReqImages:
    """A request's images (``radixserve.images``): the inputs, where their features go in the
    prompt, and (while the prompt is being computed) their features, one [length, hidden]
    per image."""

    inputs: tuple[ImageInput, ...]
    spans: tuple[ImageSpan, ...]
    features: list[torch.Tensor] | None = None


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted, prompt partly computed (chunked prefill)
    RUNNING = "running"  # prompt computed, decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One generation request inside the engine core. Slot ownership (the invariant the scheduler
    keeps): ``kv_slots[:prefix_len]`` belong to the prefix cache and are protected by the lock on
    ``last_node``; ``kv_slots[prefix_len:]`` plus ``spare_slots`` are private to this request.
    ``kv_slots[i]`` is the slot of ``fill_ids[i]``; only the first ``kv_written`` of them hold
    computed K/V (slots for the tokens of the step being run are taken before the forward and count
    as written only once it succeeded), and only those may ever enter the prefix cache."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    session_id: str | None = None  # its cached tokens are kept for the session's next turn
    low_priority_from: int | None = None  # what it caches from this position on is evicted first
    arrival: float = field(default_factory=time.monotonic)
    seq_no: int = 0  # arrival order, for FCFS ties

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    kv_slots: torch.Tensor = field(default_factory=lambda: _EMPTY)
    spare_slots: torch.Tensor = field(default_factory=lambda: _EMPTY)
    kv_written: int = 0  # leading kv_slots that hold computed K/V
    prefix_len: int = 0  # tokens of kv_slots owned by the cache (locked via last_node)
    last_node: CacheHandle | None = None  # cache handle locked by this request
    swa_released: int = 0  # hybrid models: own tokens below this gave back their window KV
    # Hybrid Mamba models: the slot of this request's recurrent state (-1: none held), and the
    # position where a prefill chunk must end so a snapshot of the state can be cached there
    # (0: none planned; ``sched/mamba.py``).
    state_slot: int = -1
    state_split: int = 0
    # Scheduling-time match (refreshed every time the queue is ordered).
    match_len: int = 0
    passed_over: int = 0  # admission rounds in which a later arrival went ahead of it
    # Statistics: prompt tokens served from the cache at first admission.
    cached_tokens: int = -1
    prompt_logprobs_sent: bool = False
    prefetch: PrefetchTicket | None = None  # the cache's L3 prefetch (HiCache), while waiting
    tier_report: dict[str, Any] | None = None  # where the cached tokens came from, at first admission

    finish_reason: str | None = None
    matched_stop: int | None = None  # the stop token id that ended it
    error: str | None = None
    generator: torch.Generator | None = None
    # Structured outputs: the live grammar (``grammar/matcher.py``), None when unconstrained.
    grammar: GrammarState | None = None
    # Speculative decoding (``sched/speculation.py``): its own n-grams, draft budget, counters.
    spec: SpecCounters | None = None
    images: ReqImages | None = None  # a vision-language request's images
    # Prompt logprobs from logprob_start_len on, accumulated over prefill chunks and
    # reported once the prompt is done: (token id, logprob or None for position 0).
    prompt_logprobs: list[tuple[int, float | None]] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    # fill_ids packed as uint32, the prefix cache's key format; grown lazily by cache_key().
    _packed: array = field(default_factory=lambda: array("I"), repr=False)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_fill(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole concatenation."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def cache_key(self, end: int | None = None) -> array:
        """``fill_ids[:end]`` as ``array('I')``, what the prefix cache reads without a copy. The
        scheduler matches waiting requests against the cache at every step (to order the queue), so
        the ids are packed once and extended as tokens are generated (``output_ids`` only ever
        grows) instead of being converted at each lookup."""
        p = self._packed
        np_, n = len(self.prompt_ids), len(p)
        if n < np_:
            p.fromlist(self.prompt_ids[n:] if n else self.prompt_ids)
            n = np_
            if self.images is not None:  # image positions are keyed by content, not by placeholder id
                for sp in self.images.spans:
                    p[sp.offset:sp.end] = array("I", span_keys(sp.key, sp.length))
        if n < np_ + len(self.output_ids):
            p.fromlist(self.output_ids[n - np_ :])
        return p if end is None or end >= len(p) else p[: max(0, end)]

    def end(self, reason: str, error: str | None = None) -> None:
        """Mark the request finished for ``reason`` (its slots are its holder's to release)."""
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason
        if error is not None:
            self.error = error
        self.finish_time = time.monotonic()

    @property
    def computed_len(self) -> int:
        """Tokens that have slots (written, or being written by the current step)."""
        return int(self.kv_slots.numel())

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.params.max_tokens - len(self.output_ids))

    @property
    def logprob_start(self) -> int:
        """First prompt position whose logprob is asked for, or -1."""
        p = self.params
        if p.logprob_start_len is not None and p.logprob_start_len >= 0:
            return min(p.logprob_start_len, len(self.prompt_ids))
        return 0 if p.prompt_logprobs else -1


@dataclass
class RequestOutput:
    """One request after a step. ``delta_*`` fields hold what this step added. The cumulative fields
    (``text``, ``token_ids``, ``logprobs``, ``top_logprobs``) are filled on the final output only
    (``finished``), so streaming a long answer never copies its whole history per token."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_tokens: int = 0  # tokens generated so far
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[tuple[int, float | None]] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_token_ids: list[int] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_by_tier: dict[str, int] | None = None  # HiCache: cached tokens per tier
    uncached_by_reason: dict[str, int] | None = None  # HiCache: why the other tokens missed
    # Speculative decoding (final output): draft tokens verified, and of those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return self.num_tokens
