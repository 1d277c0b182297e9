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

The OpenAI bodies are in ``protocol.openai``, the native ones in ``protocol.native``, a chat
request's tools in ``protocol.tool_plan``; every public name is importable from here.
"""

from radixserve.protocol.native import (NATIVE_DEFAULT_MAX_NEW_TOKENS, AbortRequest, CloseSessionRequest,
                                        FlushCacheRequest, GenerateRequest, OpenSessionRequest,
                                        native_sampling_params, native_session_id)
from radixserve.protocol.openai import (MAX_N, ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart,
                                        ImageURL, StreamOptions, response_format_schema)
from radixserve.protocol.tool_plan import ToolPlan

__all__ = [
    "MAX_N",
    "NATIVE_DEFAULT_MAX_NEW_TOKENS",
    "AbortRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CloseSessionRequest",
    "CompletionRequest",
    "ContentPart",
    "FlushCacheRequest",
    "GenerateRequest",
    "ImageURL",
    "OpenSessionRequest",
    "StreamOptions",
    "ToolPlan",
    "native_sampling_params",
    "native_session_id",
    "response_format_schema",
]
