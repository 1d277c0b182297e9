"""Request bodies of the HTTP API (pydantic 2) and their translation to ``SamplingParams``.

Two families live here:

- OpenAI: ``CompletionRequest`` and ``ChatCompletionRequest`` (field names, defaults and
  shapes follow the OpenAI reference, plus the usual open-source extras top_k, min_p,
  repetition_penalty, ignore_eos, stop_token_ids).
- SGLang native: ``GenerateRequest`` with a free-form ``sampling_params`` dict, because
  SGLang's own frontend (``RuntimeEndpoint``) sends every key of ``SglSamplingParams``,
  most of them ``None``; a strict model would reject scripts written for SGLang.

Integers are strict (``max_tokens: true`` or ``"5"`` is a client bug, not a number). Unknown
top-level keys are refused with a 400 naming them, as the OpenAI API does (a misspelt
``max_token`` must not silently mean "no limit"); keys OpenAI clients commonly send that
change nothing here (``user``, ``metadata``, ...) are accepted. Everything that needs the
model (context length, vocabulary) is checked later, by the engine, which raises ValueError.
"""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from radixserve.grammar.spec import JSON_OBJECT_SCHEMA, schema_text
from radixserve.grammar.tools import Tool, ToolChoice, call_grammar, parse_tool_choice, parse_tools
from radixserve.sampling_params import SamplingParams

# OpenAI allows n up to 128; more would only fill the scheduler queue from one request.
MAX_N = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _OpenAISampling(_Body):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Extras (vLLM / SGLang names).
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[str, float] | None = None
    # A namespace of the prefix cache (vLLM's name): requests only share cached KV with
    # requests of the same salt (and tenant).
    cache_salt: StrictStr | None = None
    # A conversation whose cached KV the engine keeps between turns (also the X-Session-Id
    # header; see radixserve.sched.sessions).
    session_id: StrictStr | None = None
    # SGLang's extensions (sglang-router sends them on every request): no_stop_trim keeps
    # the stop string, as include_stop_str_in_output does; there is no reasoning parser or
    # hidden-state output here, so the reasoning switches change nothing.
    no_stop_trim: StrictBool | None = None
    return_hidden_states: StrictBool | None = None
    separate_reasoning: StrictBool | None = None
    stream_reasoning: StrictBool | None = None
    # Structured outputs: OpenAI's response_format, and SGLang's / vLLM's extras.
    response_format: dict[str, Any] | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    # Sent by OpenAI clients; nothing here depends on them.
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None

    def _common(self) -> dict[str, Any]:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.return_hidden_states:
            raise ValueError("return_hidden_states is not supported by this server")
        kw: dict[str, Any] = {
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output or bool(self.no_stop_trim),
            "seed": self.seed,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        kw.update(self.grammar_kwargs())
        return kw

    def grammar_kwargs(self) -> dict[str, Any]:
        """The SamplingParams grammar field this body asks for (at most one)."""
        given: dict[str, Any] = {}
        schema = response_format_schema(self.response_format)
        if schema is not None:
            given["json_schema"] = schema
        if self.regex is not None:
            given["regex"] = self.regex
        if self.ebnf is not None:
            given["ebnf"] = self.ebnf
        if len(given) > 1:
            raise ValueError(f"response_format, regex and ebnf exclude each other; got {sorted(given)}")
        return given


def response_format_schema(rf: dict[str, Any] | None) -> Any:
    """OpenAI ``response_format`` -> a JSON schema (dict or text) or None for plain text.

    ``{"type": "json_object"}`` is any JSON object; ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}`` is that schema (output always matches it
    here, so ``strict`` changes nothing)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema must be an object with a \"schema\"")
        if not isinstance(js.get("name", ""), str):
            raise ValueError("response_format.json_schema.name must be a string")
        if not isinstance(js.get("strict", False), (bool, type(None))):
            raise ValueError("response_format.json_schema.strict must be a boolean")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        return schema_text(schema, "response_format.json_schema.schema")
    raise ValueError(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``: prompt is a string, a list of strings, token ids, or a list
    of token-id lists (one choice group per prompt)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, whatever shape the client used."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, seed_offset: int = 0) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        kw = self._common()
        if kw["seed"] is not None:
            kw["seed"] += seed_offset
        return SamplingParams(
            max_tokens=16 if self.max_tokens is None else self.max_tokens,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=self.echo and self.logprobs is not None,
            **kw,
        )


@dataclass(frozen=True)
class ToolPlan:
    """Tools of a chat request: what the template shows, and the grammar forcing a call when
    ``tool_choice`` requires one (None for "auto")."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool

    @property
    def grammar(self) -> str | None:
        if self.choice.mode != "required":
            return None
        return call_grammar(self.tools, self.choice, self.parallel)

    @property
    def names(self) -> set[str]:
        return set(self.choice.names)

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (``tools=...``)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]


class ImageURL(_Body):
    url: StrictStr
    detail: StrictStr | None = None  # "auto" / "low" / "high": a model here has one resolution


class ContentPart(_Body):
    """One part of a message's content: ``{"type": "text", "text": ...}`` or
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``."""

    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageURL | StrictStr | None = None

    def url(self) -> str | None:
        u = self.image_url
        return u.url if isinstance(u, ImageURL) else u


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) are kept: the template may use them.
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None

    def as_template_dict(self, image_token: str | None = None, where: str = "content") -> dict[str, Any]:
        """The message as the chat template wants it: content flattened to one string, each
        image part written as the model's ``image_token`` (``"<image>"``) where it was. With
        no ``image_token`` (a text model) an image part is refused, naming it (``where`` is
        the message's field, e.g. ``messages[0]``)."""
        d = self.model_dump(exclude_none=True)
        c = self.content
        if c is None:
            d["content"] = ""
        elif isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                at = f"{where}.content[{j}]"
                if part.type == "text" and part.text is not None:
                    texts.append(part.text)
                elif part.type == "image_url":
                    if part.image_url is None:
                        raise ValueError(f"{at}.image_url: field required")
                    if image_token is None:
                        raise ValueError(f"{at}.image_url: this model does not accept images")
                    texts.append(image_token)
                elif part.type == "text":
                    raise ValueError(f"{at}.text: field required")
                else:
                    raise ValueError(f"{at}.type: content part type {part.type!r} is not supported "
                                     "(text and image_url)")
            d["content"] = "".join(texts)
        return d

    def image_refs(self, where: str = "content") -> list[tuple[str, str]]:
        """``(field, url)`` of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(f"{where}.content[{j}].image_url", p.url() or "")
                for j, p in enumerate(self.content) if p.type == "image_url" and p.image_url is not None]


class ChatCompletionRequest(_OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    def template_messages(self, image_token: str | None = None) -> list[dict[str, Any]]:
        """The messages for the chat template; image parts become ``image_token`` (refused
        when None: the model takes no images)."""
        if not self.messages:
            raise ValueError("messages must not be empty")
        return [m.as_template_dict(image_token, f"messages[{i}]") for i, m in enumerate(self.messages)]

    def image_refs(self) -> list[tuple[str, str]]:
        """``(field, url)`` of every image part, in the order the template text holds them."""
        return [r for i, m in enumerate(self.messages) for r in m.image_refs(f"messages[{i}]")]

    def tool_plan(self) -> ToolPlan | None:
        """The tools offered and how the answer may use them; None without tools (or with
        ``tool_choice: "none"``, which renders no tools and parses no calls)."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice requires tools")
            return None
        tools = parse_tools(self.tools)
        choice = parse_tool_choice(self.tool_choice, tools)
        if choice.mode == "none":
            return None
        plan = ToolPlan(tools, choice, bool(self.parallel_tool_calls))
        if plan.grammar is not None and self.grammar_kwargs():
            raise ValueError("tool_choice that requires a call excludes response_format, regex and ebnf")
        return plan

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sampling_params(self, max_tokens: int, seed_offset: int = 0,
                        plan: ToolPlan | None = None) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        kw = self._common()
        if plan is not None and plan.grammar is not None:
            kw["ebnf"] = plan.grammar
        if kw["seed"] is not None:
            kw["seed"] += seed_offset
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            **kw,
        )


# --------------------------------------------------------------------------- native API

# Keys of SGLang's sampling params that we implement, with their SamplingParams name.
_NATIVE_KEYS: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "seed": "seed",
    "sampling_seed": "seed",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
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


class GenerateRequest(_Body):
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
_SESSION_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "rid": (None,),
    "offset": (None, 0),
    "replace": (None, False),
    "drop_previous_output": (None, False),
}


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
    timeout: float | None = None  # this session's TTL in seconds (default: the engine's)


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: StrictStr


class FlushCacheRequest(_Body):
    empty_cache: StrictBool = True
    timeout: float | None = None


class AbortRequest(_Body):
    rid: StrictStr
