"""Request bodies of the HTTP API (pydantic 2) and their translation to ``SamplingParams``.

OpenAI's bodies are in ``protocol.openai``, SGLang's native ones in ``protocol.native``, a chat
request's tools in ``protocol.tool_plan``, the rules every route shares in ``protocol.rules``;
every public name is importable from here. Integers are strict (``max_tokens: true`` or ``"5"``
is a client bug, not a number) and unknown top-level keys are refused (``protocol.base``).
Everything that needs the model (context length, vocabulary) is checked later, by the engine,
which raises ValueError.
"""

from radixserve.protocol.native import (NATIVE_DEFAULT_MAX_NEW_TOKENS, AbortRequest, CloseSessionRequest,
                                        FlushCacheRequest, GenerateRequest, OpenSessionRequest,
                                        native_sampling_params, native_session_id)
from radixserve.protocol.openai import (MAX_N, ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart,
                                        ImageURL, StreamOptions, response_format_schema)
from radixserve.protocol.tool_plan import ToolPlan

__all__ = [
    "MAX_N", "NATIVE_DEFAULT_MAX_NEW_TOKENS", "AbortRequest", "ChatCompletionRequest", "ChatMessage",
    "CloseSessionRequest", "CompletionRequest", "ContentPart", "FlushCacheRequest", "GenerateRequest",
    "ImageURL", "OpenSessionRequest", "StreamOptions", "ToolPlan", "native_sampling_params",
    "native_session_id", "response_format_schema",
]
