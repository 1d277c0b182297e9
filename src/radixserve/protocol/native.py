"""SGLang's native request bodies: ``/generate``, sessions, cache flush and abort.

``GenerateRequest`` takes a free-form ``sampling_params`` dict because SGLang's own frontend
(``RuntimeEndpoint``) sends every key of ``SglSamplingParams``, most of them ``None``: a
strict model would reject scripts written for SGLang. Keys we do not implement are refused
unless they hold their neutral value, so a script that depends on one fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from radixserve.protocol.base import Body
from radixserve.protocol.rules import RequestLimits, check_cache_salt, check_n, check_name
from radixserve.sampling_params import SamplingParams

# Keys of SGLang's sampling params that we implement, with their SamplingParams name.
_NATIVE_KEYS: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "sampling_seed": "seed",
    **{k: k for k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                      "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                      "seed", "regex", "json_schema", "ebnf")},
}
# Keys SglSamplingParams always sends; harmless at their neutral value, refused otherwise so
# a script that relies on e.g. regex-constrained decoding fails loudly instead of silently.
_NATIVE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop_regex": (None, (), []),
    "min_new_tokens": (None, 0),
    "spaces_between_special_tokens": (None, True, False),
    "no_stop_trim": (None, False),
    "n": (None, 1),  # n > 1 is handled by the caller (fan-out), not by SamplingParams
    "custom_params": (None,),
    "logit_bias": (None, {}),
}
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128


def native_sampling_params(
    sp: dict[str, Any] | None,
    *,
    return_logprob: bool,
    logprob_start_len: int,
    top_logprobs_num: int,
    seed_offset: int = 0,
    vocab_size: int | None = None,
) -> SamplingParams:
    """SGLang ``sampling_params`` dict -> SamplingParams (ValueError names the bad key)."""
    sp = dict(sp or {})
    kw: dict[str, Any] = {"max_tokens": NATIVE_DEFAULT_MAX_NEW_TOKENS}
    for key, value in sp.items():
        if key in _NATIVE_KEYS:
            if value is None:
                continue
            kw[_NATIVE_KEYS[key]] = value
        elif key in _NATIVE_NEUTRAL:
            if value not in _NATIVE_NEUTRAL[key] and key != "n":
                raise ValueError(f"sampling_params.{key} is not supported by this server")
        else:
            raise ValueError(f"sampling_params.{key} is not a known sampling parameter")
    if isinstance(kw.get("stop"), tuple):
        kw["stop"] = list(kw["stop"])
    # SGLang uses huge top_k values (1 << 30) to mean "off".
    tk = kw.get("top_k")
    if isinstance(tk, int) and not isinstance(tk, bool) and vocab_size and tk >= vocab_size:
        kw["top_k"] = -1
    if kw.get("seed") is not None and isinstance(kw["seed"], int):
        kw["seed"] += seed_offset
    try:
        return SamplingParams(
            logprobs=return_logprob,
            top_logprobs=top_logprobs_num if return_logprob else 0,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            **kw,
        )
    except ValueError as e:
        # Name the field the way the client spelled it.
        msg = str(e).replace("SamplingParams.max_tokens", "sampling_params.max_new_tokens")
        msg = msg.replace("SamplingParams.top_logprobs", "top_logprobs_num")
        raise ValueError(msg.replace("SamplingParams.", "sampling_params.")) from None


@dataclass(frozen=True)
class NativeItem:
    """One prompt of a ``/generate`` request and the fields that apply to it."""

    index: int
    prompt: str | list[int]
    sampling: dict[str, Any] | None
    n: int  # choices of this prompt
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str | None  # the client's name for it
    session_id: str | None

    def sampling_params(self, prompt_len: int, seed_offset: int, vocab_size: int) -> SamplingParams:
        start = self.logprob_start_len
        if self.return_logprob and (start < 0 or start >= prompt_len):
            start = prompt_len - 1  # SGLang's default: only the last prompt token
        return native_sampling_params(self.sampling, return_logprob=self.return_logprob, logprob_start_len=start,
                                      top_logprobs_num=self.top_logprobs_num, seed_offset=seed_offset,
                                      vocab_size=vocab_size)


class GenerateRequest(Body):
    """``POST /generate`` in SGLang's shape (``GenerateReqInput``).

    Unknown top-level keys are ignored here, unlike on the OpenAI routes: SGLang's frontend
    and router add keys of their own (``model``, ``background``, ...) that change nothing for
    a single-engine server. Unknown *sampling* parameters are still refused (a silently
    ignored ``regex`` would change what the client gets)."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | list[StrictBool] = False
    logprob_start_len: StrictInt | list[StrictInt] = -1
    top_logprobs_num: StrictInt | list[StrictInt] = 0
    return_text_in_logprobs: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None
    image_data: Any = None
    cache_salt: StrictStr | None = None
    # SGLang's sessions: {"id": ...} keeps the conversation's cached KV between turns.
    session_params: dict[str, Any] | list[dict[str, Any]] | None = None
    model: StrictStr | None = None  # added by routers (sglang-router); checked like OpenAI's
    data_parallel_rank: StrictInt | None = None  # SGLang's DP hint: one rank here, ignored
    # Sent by SGLang's frontend at their neutral values; anything else is refused.
    modalities: Any = None
    lora_path: Any = None
    return_hidden_states: StrictBool = False
    log_metrics: StrictBool = True
    custom_logit_processor: Any = None
    stream_interval: Any = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        return check_cache_salt(v)

    def check_neutral(self) -> None:
        for name in ("modalities", "lora_path", "custom_logit_processor"):
            if getattr(self, name) not in (None, [], ""):
                raise ValueError(f"{name} is not supported by this server")
        if self.return_hidden_states:
            raise ValueError("return_hidden_states is not supported by this server")

    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        if self.text is not None:
            prompts: list[Any] = self.text if isinstance(self.text, list) else [self.text]
        else:
            ids = self.input_ids or []
            if not ids:
                raise ValueError("input_ids must not be empty")
            prompts = list(ids) if isinstance(ids[0], list) else [ids]
        if not prompts:
            raise ValueError("the batch must not be empty")
        return prompts

    def image_refs(self, size: int) -> list[list[tuple[str, str]]]:
        """``(field, image)`` per prompt, SGLang's way: for one prompt, ``image_data`` is an
        image or a list of them; for a batch, a list with one entry (an image, a list, or
        null) per prompt. An image is a data URI, base64 or a URL."""
        d = self.image_data
        if d is None or d == [] or d == "":
            return [[] for _ in range(size)]
        if not self.is_batch():
            return [_image_list(d, "image_data")]
        if not isinstance(d, list) or len(d) != size:
            got = f"{len(d)} entries" if isinstance(d, list) else type(d).__name__
            raise ValueError(f"image_data must be a list with one entry per prompt ({size}), got {got}")
        return [_image_list(x, f"image_data[{i}]") for i, x in enumerate(d)]

    def items(self, limits: RequestLimits) -> list[NativeItem]:
        """Every prompt with the fields that apply to it, checked against the rules and the
        operator's limits (ProtocolError / ValueError naming the field)."""
        self.check_neutral()
        prompts = self.prompts()
        size = len(prompts)
        if isinstance(self.sampling_params, list) and not self.is_batch():
            raise ValueError("sampling_params must be an object for a single prompt")
        limits.counts(size, 1)
        items, total = [], 0
        for i, prompt in enumerate(prompts):
            sp = self.per_item("sampling_params", i, size)
            n = check_n(sp.get("n") if isinstance(sp, dict) else None, "sampling_params.n")
            total += n
            limits.counts(1, total)
            if isinstance(sp, dict):
                limits.stops(sp.get("stop"), sp.get("stop_token_ids"), "sampling_params.stop",
                             "sampling_params.stop_token_ids")
            rid = self.per_item("rid", i, size)
            if rid is not None:
                check_name(rid, f"rid[{i}]" if isinstance(self.rid, list) else "rid")
            sess = self.per_item("session_params", i, size)
            items.append(NativeItem(i, prompt, sp, n, self.per_item("return_logprob", i, size),
                                    self.per_item("logprob_start_len", i, size),
                                    self.per_item("top_logprobs_num", i, size), rid, native_session_id(sess)))
        return items

    def per_item(self, name: str, i: int, size: int) -> Any:
        """A field that may be given once for the batch or once per item."""
        v = getattr(self, name)
        if isinstance(v, list) and name != "text" and name != "input_ids":
            if len(v) != size:
                raise ValueError(f"{name} has {len(v)} entries for a batch of {size}")
            return v[i]
        return v


def _image_list(x: Any, field: str) -> list[tuple[str, str]]:
    if x is None:
        return []
    if isinstance(x, str):
        return [(field, x)]
    if isinstance(x, list):
        out = []
        for j, y in enumerate(x):
            if not isinstance(y, str):
                raise ValueError(f"{field}[{j}] must be a string (a data URI or base64), got {type(y).__name__}")
            out.append((f"{field}[{j}]", y))
        return out
    raise ValueError(f"{field} must be a string or a list of strings (data URIs or base64), "
                     f"got {type(x).__name__}")


# SGLang's session_params keys beyond ``id`` splice the new turn onto a stored request's
# tokens; here a client sends the whole conversation, so they are refused unless neutral.
_SESSION_NEUTRAL: dict[str, tuple[Any, ...]] = {"rid": (None,), "offset": (None, 0), "replace": (None, False),
                                                "drop_previous_output": (None, False)}


def native_session_id(sp: Any, field: str = "session_params") -> str | None:
    """The session id of SGLang's ``session_params`` (``{"id": ..., "rid": ..., "offset": ...,
    "replace": ..., "drop_previous_output": ...}``), or None; ValueError names the bad key."""
    if sp is None:
        return None
    if not isinstance(sp, dict):
        raise ValueError(f"{field} must be an object like {{\"id\": \"...\"}}")
    for key, value in sp.items():
        if key == "id":
            continue
        if key not in _SESSION_NEUTRAL:
            raise ValueError(f"{field}.{key} is not a known session parameter")
        if value not in _SESSION_NEUTRAL[key]:
            raise ValueError(f"{field}.{key} is not supported by this server: send the whole "
                             "conversation as the prompt; the session keeps its KV cached")
    sid = sp.get("id")
    if sid is not None and not isinstance(sid, str):
        raise ValueError(f"{field}.id must be a string, got {type(sid).__name__}")
    return sid


class OpenSessionRequest(BaseModel):
    """``/open_session`` in SGLang's shape (``OpenSessionReqInput``); unknown keys ignored."""

    model_config = ConfigDict(extra="ignore")

    capacity_of_str_len: StrictInt | None = Field(None, ge=0)  # SGLang's; nothing to size here
    session_id: StrictStr | None = None
    streaming: StrictBool | None = None  # every session here keeps its KV, as SGLang's streaming ones
    timeout: StrictFloat | None = None  # this session's TTL in seconds (default: the engine's)


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: StrictStr


class FlushCacheRequest(Body):
    empty_cache: StrictBool = True
    timeout: StrictFloat | None = None


class AbortRequest(Body):
    rid: StrictStr


class ImageInputSpec(msgspec.Struct, frozen=True):
    """The ``vision`` block of ``/get_model_info``: the image placeholder, what the core
    expands it to, and the preprocessing (``ImageProcessorConfig`` fields; tuples as lists)."""

    image_token_id: int
    image_token: str
    tokens_per_image: int
    processor: dict[str, Any]


class ServedModelInfo(msgspec.Struct, frozen=True):
    """``GET /get_model_info``: SGLang's fields plus the chat template and the image input,
    what a frontend (``lang``) or the router learns about a worker's model. Read leniently
    (:meth:`parse`): another server (SGLang) may leave fields out or add its own."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    is_generation: bool = True
    model_type: str | None = None
    max_context_len: int | None = None
    vocab_size: int | None = None
    preferred_sampling_params: Any = None
    # Lets a frontend (radixserve.lang.RuntimeEndpoint) render role blocks exactly as
    # /v1/chat/completions does (None: it refuses chat, see below).
    chat_template: str | None = None
    weight_version: Any = "default"
    # True when the model ships no template (a base model, most likely: better prompted with
    # raw text); chat then needs the server's --chat-template.
    chat_template_builtin: bool = False
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    architectures: list[str] | None = None
    vision: ImageInputSpec | None = None  # None: a text model

    @classmethod
    def parse(cls, data: bytes | str | dict[str, Any]) -> "ServedModelInfo":
        """From a response body (ValueError when it is not such an object)."""
        obj = msgspec.json.decode(data) if isinstance(data, (bytes, str)) else data
        return msgspec.convert(obj, cls, strict=False)

    def as_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)
