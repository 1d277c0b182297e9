"""What crosses the boundary between the API side and the engine core: token ids, not text.

msgspec structs encoded as MessagePack (compact, and decoding validates the shape). The API
side sends a list of :data:`Command` per message (everything it has gathered since the last
send, so n choices of one request land in the same scheduling round); the core sends one
:class:`StepOutputs` per step with every request that advanced or ended, plus the answers to
utility calls and its load.

Images travel preprocessed (:class:`ImagePayload`): the API process decodes, preprocesses
and hashes them, so the core never parses untrusted image formats; the pixels go as one
``bytes`` of float32 (MessagePack bin, no per-float encoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec
import torch

from radixserve.images import ImageInput
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
    draft_tokens: int = 0  # speculative decoding: draft tokens verified so far
    accepted_draft_tokens: int = 0  # of those, accepted


class ImagePayload(msgspec.Struct, array_like=True):
    """One preprocessed image on the wire: its content digest and its float32 pixel values
    [3, H, W] as raw bytes in C order and this host's byte order (both ends of the socket
    are processes of one machine)."""

    digest: str
    shape: tuple[int, int, int]
    data: bytes

    @classmethod
    def of(cls, image: ImageInput) -> "ImagePayload":
        pv = image.pixel_values.detach().to("cpu").contiguous()
        c, h, w = pv.shape
        return cls(image.digest, (int(c), int(h), int(w)), pv.numpy().tobytes())

    def to_image(self) -> ImageInput:
        """The :class:`ImageInput` again; ValueError when the bytes do not match the shape."""
        shape = tuple(self.shape)
        if len(shape) != 3 or any(d < 1 for d in shape):
            raise ValueError(f"images: bad pixel shape {list(shape)}")
        if len(self.data) != 4 * shape[0] * shape[1] * shape[2]:
            raise ValueError(f"images: {len(self.data)} bytes of pixels for shape {list(shape)}")
        # bytearray: a writable copy (torch.frombuffer warns on read-only buffers).
        pv = torch.frombuffer(bytearray(self.data), dtype=torch.float32).view(shape)
        return ImageInput(self.digest, pv)


def images_to_wire(images: Sequence[ImageInput] | None) -> list[ImagePayload]:
    return [ImagePayload.of(im) for im in images or ()]


def images_from_wire(payloads: Sequence[ImagePayload]) -> list[ImageInput] | None:
    """The core's ``images`` argument (None for a text request)."""
    return [p.to_image() for p in payloads] or None


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    arrival: float = 0.0
    session_id: str | None = None
    images: list[ImagePayload] = []  # one per image placeholder of prompt_ids, in order
    low_priority_from: int | None = None  # what it caches from here on is evicted first


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


#: What a utility call returns (``EngineCore.call``): plain data, as msgpack carries it.
CallValue = Union[None, bool, int, float, str, list, dict]


class CallResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    ok: bool = True
    value: CallValue = None
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


class VisionSpec(msgspec.Struct, array_like=True, frozen=True):
    """A vision model's image input: the placeholder token, what it expands to, and the
    preprocessing (:class:`~radixserve.model.vision.image_processor.ImageProcessorConfig` fields;
    tuples arrive as lists)."""

    image_token_id: int
    tokens_per_image: int
    processor: dict[str, Any]


class ModelInfo(msgspec.Struct, array_like=True, frozen=True):
    """What the API side needs to know about the served model, sent once by a ready core.

    The HTTP routes (``/get_model_info``, ``/server_info``), the request limits and the
    routers read it by attribute; a missing field is a decoding error, not a guessed default."""

    model: str
    arch: str | None
    vocab_size: int
    max_context_len: int
    eos_ids: list[int]
    kv_capacity_tokens: int
    max_running_requests: int
    page_size: int
    dtype: str
    kv_cache_dtype: str
    tp_size: int
    vision: VisionSpec | None = None
    dp_size: int = 1  # cores behind one API process (the data-parallel client sums their capacity)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """First message of a core: what the API side needs to know about the model."""

    info: ModelInfo


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
