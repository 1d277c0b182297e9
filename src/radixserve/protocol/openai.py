"""OpenAI request bodies: ``CompletionRequest`` and ``ChatCompletionRequest``.

Field names, defaults and shapes follow the OpenAI reference, plus the usual open-source
extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) and SGLang's / vLLM's
structured-output keys. Keys OpenAI clients commonly send that change nothing here
(``user``, ``metadata``, ...) are accepted; any other unknown key is a 400 naming it.

Numbers are strict, as OpenAI's are: an integer is a fine float (``"temperature": 1``), a
boolean or a numeric string is not (``"temperature": true`` would otherwise be 1.0 here and
a 400 on ``/generate``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from radixserve.grammar.spec import JSON_OBJECT_SCHEMA, check_schema_size, schema_text
from radixserve.grammar.tools import parse_tool_choice, parse_tools
from radixserve.protocol.base import Body
from radixserve.protocol.rules import MAX_N, ProtocolError, RequestLimits, check_cache_salt
from radixserve.protocol.tool_plan import ToolPlan
from radixserve.sampling_params import SamplingParams


class StreamOptions(Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class PredictionPart(Body):
    """One text part of a prediction's content (OpenAI allows only text parts there)."""

    type: Literal["text"]
    text: StrictStr


class Prediction(Body):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": "..." | [text parts]}``,
    text the answer is expected to repeat (a file being edited, a record re-emitted). Here it
    is one more draft source for speculative decoding (``sched/speculation.py``): it never
    changes the output, only how many tokens a step may verify; without ``--speculative`` it
    is accepted and changes nothing."""

    type: Literal["content"]
    content: StrictStr | list[PredictionPart]

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


class _OpenAISampling(Body):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Extras (vLLM / SGLang names).
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[str, StrictFloat] | None = None
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
    # Predicted Outputs: a draft source for speculative decoding (tokenized by the route).
    prediction: Prediction | None = None
    # Sent by OpenAI clients; nothing here depends on them.
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        return check_cache_salt(v)

    def check_limits(self, limits: RequestLimits, num_prompts: int) -> None:
        """The operator's limits on choices and stops (ProtocolError naming the field)."""
        limits.counts(num_prompts, self.n)
        limits.stops(self.stop, self.stop_token_ids)

    def grammar_field(self) -> str | None:
        """The field this body's grammar came from (for a 400's ``param``)."""
        given = self.grammar_kwargs()
        if "json_schema" in given:
            return "response_format"
        return next(iter(given), None)

    def _common(self, seed_offset: int) -> dict[str, Any]:
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
            "seed": None if self.seed is None else self.seed + seed_offset,
        }
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")
        kw.update({name: getattr(self, name) for name in names if getattr(self, name) is not None})
        kw.update(self.grammar_kwargs())
        return kw

    def grammar_kwargs(self) -> dict[str, Any]:
        """The SamplingParams grammar field this body asks for (at most one)."""
        asked = {"json_schema": response_format_schema(self.response_format), "regex": self.regex, "ebnf": self.ebnf}
        given = {k: v for k, v in asked.items() if v is not None}
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

    def sampling_params(self, seed_offset: int = 0, prediction: list[int] | None = None) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        kw = self._common(seed_offset)
        return SamplingParams(
            max_tokens=16 if self.max_tokens is None else self.max_tokens,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            prompt_logprobs=self.echo and self.logprobs is not None,
            prediction=prediction,
            **kw,
        )

class ImageURL(Body):
    url: StrictStr
    detail: StrictStr | None = None  # "auto" / "low" / "high": a model here has one resolution


class ContentPart(Body):
    """One part of a message's content: ``{"type": "text", "text": ...}`` or
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``."""

    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageURL | StrictStr | None = None

    def url(self) -> str | None:
        u = self.image_url
        return u.url if isinstance(u, ImageURL) else u


#: OpenAI's message roles ("function" is its deprecated form of "tool").
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ToolCallFunction(BaseModel):
    """The function an earlier assistant turn called. ``arguments`` is the JSON text the
    model wrote (or, as some clients send it, the object)."""

    model_config = ConfigDict(extra="allow")

    name: StrictStr
    arguments: StrictStr | dict[str, Any] | None = None

    @field_validator("arguments")
    @classmethod
    def _parseable_depth(cls, v: Any) -> Any:
        # Templates and the tool-call renderer parse the text: JSON nested ~1,000 deep
        # exhausts Python's stack there. Text that is not JSON at all stays allowed (a
        # model's malformed call, replayed as it was).
        if isinstance(v, str):
            try:
                json.loads(v)
            except RecursionError:
                raise ValueError("the arguments are nested too deeply") from None
            except ValueError:
                pass
        return v


class HistoryToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls`` in the chat history."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) are kept: the template may use them.
    model_config = ConfigDict(extra="allow")

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[HistoryToolCall] | None = None

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
        check_schema_size([t.parameters for t in tools], "tools")
        choice = parse_tool_choice(self.tool_choice, tools)
        if choice.mode == "none":
            return None
        return ToolPlan(tools, choice, bool(self.parallel_tool_calls), own_grammar=bool(self.grammar_kwargs()))

    def max_tokens_for(self, prompt_len: int, context_len: int) -> int:
        """Tokens to generate at most: as asked (max_completion_tokens, the newer name, wins
        over max_tokens), or (OpenAI's default) what the context window leaves after the prompt."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = max(0, context_len - prompt_len)
            if max_tokens == 0:
                raise ProtocolError(f"the prompt has {prompt_len} tokens; the context length is {context_len}",
                                    "messages")
        elif max_tokens < 1:
            raise ProtocolError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        return max_tokens

    def sampling_params(self, max_tokens: int, seed_offset: int = 0,
                        plan: ToolPlan | None = None, prediction: list[int] | None = None) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        kw = self._common(seed_offset)
        if plan is not None and plan.grammar is not None:
            kw["ebnf"] = plan.grammar
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            prediction=prediction,
            **kw,
        )
