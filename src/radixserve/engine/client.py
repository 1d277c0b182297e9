"""What both clients of an engine core share: submissions, errors, the hello and the output
processor.

Both send :data:`~radixserve.engine.messages.Command` lists and turn the core's
:class:`StepOutputs` into :class:`RequestOutput` s with one :class:`OutputProcessor`
(detokenization and stop strings happen here, never in the core). Commands issued in one
go (the n choices of a request, an abort burst) are sent as one message, so they reach the
same scheduling round.

If the core dies, every open request fails at once with :class:`EngineDeadError` and
every later call raises it: nothing waits on a core that is gone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.request import RequestOutput
from radixserve.engine.launch import CoreHandle
from radixserve.engine.messages import (
    AddRequest, Failed, Load, ModelInfo, Ready, StepOutputs, command_encoder, hello_decoder, images_to_wire,
    output_decoder,
)
from radixserve.engine.output import OutputProcessor
from radixserve.images import ImageInput, expand_prompt, keyed_prompt
from radixserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core is not running (it failed to start, crashed, or was stopped)."""


class EngineCallError(RuntimeError):
    """A utility call failed inside the core; ``error_type`` names the exception there."""

    def __init__(self, message: str, error_type: str | None):
        super().__init__(message)
        self.error_type = error_type


@dataclass
class Submission:
    """One request for the core: token ids, sampling params, cache salt, session, and for a
    vision-language model its images (one per image placeholder token of ``prompt_ids``)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None
    session_id: str | None = None
    images: Sequence[ImageInput] = ()
    low_priority_from: int | None = None  # a router's hint (``radixserve.cache.radix``)

    def command(self, arrival: float) -> AddRequest:
        return AddRequest(self.rid, self.prompt_ids, self.params, self.salt, arrival, self.session_id,
                          images_to_wire(self.images), self.low_priority_from)


def _with_images(item: Submission, info: ModelInfo | None, keyed: bool) -> list[int]:
    """``item``'s prompt expanded as the core expands it (``keyed``: with the image positions'
    tree keys); unchanged without images, or when the placeholders do not match (the core
    refuses the request then, with the reason)."""
    vision = info.vision if info is not None else None
    if not item.images or vision is None:
        return item.prompt_ids
    args = (item.prompt_ids, vision.image_token_id, vision.tokens_per_image,
            [im.digest for im in item.images])
    try:
        return keyed_prompt(*args) if keyed else expand_prompt(*args)[0]
    except ValueError:
        return item.prompt_ids


def shown_prompt(item: Submission, info: ModelInfo | None) -> list[int]:
    """The prompt as the core runs it: each image placeholder expanded to the model's
    ``tokens_per_image`` (so prompt token counts and ``prompt_token_ids`` match what the core
    computed and cached)."""
    return _with_images(item, info, keyed=False)


def cache_key_tokens(item: Submission, info: ModelInfo | None) -> list[int]:
    """The prompt's prefix-tree keys as the core derives them, for routing by the cores'
    cache events (``radixserve.images.keyed_prompt``)."""
    return _with_images(item, info, keyed=True)


class ClientBase:
    """What both clients share: the request table, the output processor, the sockets."""

    def __init__(self, handle: CoreHandle | None, tokenizer: Any):
        self.handle: CoreHandle = handle  # type: ignore[assignment]
        self.processor = OutputProcessor(tokenizer)
        self.enc = command_encoder()
        self.out_dec = output_decoder()
        self.info: ModelInfo | None = None  # from the core, once ready
        self.load: Load | None = None
        self.ready = False
        self.dead_reason: str | None = None
        self._call_ids = itertools.count(1)
        self.on_output: list[Callable[[RequestOutput], None]] = []

    @property
    def alive(self) -> bool:
        return self.ready and self.dead_reason is None

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.ready:
            raise EngineDeadError("the engine core is not ready yet")

    def _handle_hello(self, raw: bytes) -> None:
        hello = hello_decoder().decode(raw)
        if isinstance(hello, Failed):
            self.dead_reason = f"the engine core failed to start: {hello.error}"
            raise EngineDeadError(self.dead_reason)
        assert isinstance(hello, Ready)
        self.info = hello.info
        self.ready = True

    def _process(self, msg: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        if msg.load is not None:
            self.load = msg.load
        return self.processor.process(msg.outputs)
