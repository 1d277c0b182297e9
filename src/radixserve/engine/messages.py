"""What crosses the boundary between the API side and the engine core: token ids, not text.

msgspec structs encoded as MessagePack (compact, and decoding validates the shape). The API
side sends a list of :data:`Command` per message (everything it has gathered since the last
send, so n choices of one request land in the same scheduling round); the core sends one
:class:`StepOutputs` per step with every request that advanced or ended, plus the answers to
utility calls and its load.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from radixserve.sampling_params import SamplingParams


class ReqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did to one request (only what changed)."""

    rid: str
    new_token_ids: list[int] = []
    cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | None = None  # the stop token id (stop strings are matched API-side)
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[tuple[int, float | None]] | None = None  # once, when complete
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    cached_by_tier: dict[str, int] | None = None  # HiCache: cached tokens per tier (once)
    uncached_by_reason: dict[str, int] | None = None  # HiCache: why the rest missed (once)


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    arrival: float = 0.0
    session_id: str | None = None


class Abort(msgspec.Struct, tag="abort", array_like=True):
    rids: list[str]
    reason: str = "abort"


class Call(msgspec.Struct, tag="call", array_like=True):
    """A utility call run on the core between two steps (stats, flush_cache, ...)."""

    call_id: int
    method: str
    args: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = Union[AddRequest, Abort, Call, Shutdown]


class CallResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    ok: bool = True
    value: Any = None
    error: str | None = None
    error_type: str | None = None


class Load(msgspec.Struct, array_like=True):
    running: int
    waiting: int
    kv_free_tokens: int


class StepOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[ReqDelta] = []
    results: list[CallResult] = []
    load: Load | None = None
    # The core's last words before it exits on a fault it cannot recover from (a failed
    # tensor-parallel rank): the API side reports this instead of a bare exit status.
    fatal: str | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """First message of a core: what the API side needs to know about the model."""

    info: dict[str, Any]


class Failed(msgspec.Struct, tag="failed", array_like=True):
    error: str


Hello = Union[Ready, Failed]

# Encoders/decoders are not thread-safe to share across threads in every msgspec version:
# each side builds its own with these helpers.


def command_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(list[Command])


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(StepOutputs)


def hello_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Hello)
