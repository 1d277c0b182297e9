"""Requests as the scheduler and engine see them, and what a step hands back to callers."""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted, prompt partly computed (chunked prefill)
    RUNNING = "running"  # prompt computed, decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One generation request inside the engine.

    Slot ownership (the invariant the scheduler keeps): ``kv_slots[:prefix_len]`` belong to
    the prefix cache and are protected by the lock on ``last_node``; ``kv_slots[prefix_len:]``
    plus ``spare_slots`` are private to this request and freed by the scheduler when it is
    done with them. ``kv_slots`` holds the K/V of ``fill_ids[:len(kv_slots)]``.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: Any = None
    arrival: float = field(default_factory=time.monotonic)
    seq_no: int = 0  # arrival order, for FCFS ties

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    spare_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    prefix_len: int = 0  # tokens of kv_slots owned by the cache (locked via last_node)
    last_node: Any = None  # cache handle locked by this request, or None
    # Scheduling-time match (refreshed every time the queue is ordered).
    match_len: int = 0
    # Statistics: prompt tokens served from the cache at first admission.
    cached_tokens: int = -1
    computed_prompt_tokens: int = 0
    num_retractions: int = 0

    finish_reason: str | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    generator: torch.Generator | None = None
    # Per output token: logprob of the chosen token, and top alternatives.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt logprobs from logprob_start_len on: (token id, logprob or None for the first).
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

    def cache_key(self, end: int | None = None) -> array:
        """``fill_ids[:end]`` as ``array('I')``, what the prefix cache reads without a copy.

        The scheduler matches every waiting request against the cache at every step (to
        order the queue), so the ids are packed once and extended as tokens are generated
        (``output_ids`` only ever grows) instead of being converted at each lookup."""
        p = self._packed
        np_, n = len(self.prompt_ids), len(p)
        if n < np_:
            p.fromlist(self.prompt_ids[n:] if n else self.prompt_ids)
            n = np_
        if n < np_ + len(self.output_ids):
            p.fromlist(self.output_ids[n - np_ :])
        return p if end is None or end >= len(p) else p[: max(0, end)]

    @property
    def computed_len(self) -> int:
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
        if p.prompt_logprobs:
            return 0
        return -1


@dataclass
class RequestOutput:
    """The state of one request after a step: cumulative text and ids, plus this step's delta."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    text: str
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[tuple[int, float | None]] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_token_ids: list[int] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
