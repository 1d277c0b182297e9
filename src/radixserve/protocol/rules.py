"""The rules a request must follow, written once for every route (OpenAI and native).

Each rule raises :class:`ProtocolError` naming the field; the server answers it as a 400 in
OpenAI's error shape. The pydantic bodies call the fixed rules (``n``, ``cache_salt``) in
their validators; the limits an operator sets (:class:`RequestLimits`, from
``ServerConfig``) are checked by the routes before any work is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_N", "MAX_CACHE_SALT_CHARS", "ProtocolError", "RequestLimits", "check_cache_salt", "check_n",
           "check_name"]

# OpenAI allows n up to 128; more would only fill the scheduler queue from one request.
MAX_N = 128
MAX_CACHE_SALT_CHARS = 256


class ProtocolError(ValueError):
    """A request that breaks a rule of the protocol: ``param`` names the field, ``code`` is
    OpenAI's machine-readable reason (both go into the 400's body)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_n(n: Any, field: str = "n") -> int:
    """Choices per prompt: an integer in [1, MAX_N] (None: 1)."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ProtocolError(f"{field} must be an integer in [1, {MAX_N}], got {n!r}", field)
    return n


def check_name(value: str, field: str) -> str:
    """A client-chosen name (a request id, a salt): it is echoed in responses and logs, so
    it must be valid Unicode — a lone surrogate cannot be written as UTF-8 JSON."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(f"{field} contains text that is not valid Unicode (a lone surrogate)", field) from None
    return value


def check_cache_salt(salt: str | None) -> str | None:
    """A cache namespace: a non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    if salt is None:
        return None
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ProtocolError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                            "characters", "cache_salt")
    return check_name(salt, "cache_salt")


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", dict: "an object", str: "a string"}
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (``ServerConfig`` fields of the same names): a server
    exposed to clients it does not trust bounds every input that costs memory or time."""

    max_prompt_chars: int
    max_prompts_per_request: int
    max_choices_per_request: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int

    @classmethod
    def from_config(cls, cfg: Any) -> "RequestLimits":
        return cls(cfg.max_prompt_chars, cfg.max_prompts_per_request, cfg.max_choices_per_request,
                   cfg.max_stop_strings, cfg.max_stop_string_chars, cfg.max_stop_token_ids)

    def text(self, value: str, field: str) -> None:
        """A prompt or message: not too long, and encodable (no lone surrogates)."""
        if len(value) > self.max_prompt_chars:
            raise ProtocolError(f"{field} has {len(value)} characters; the limit is {self.max_prompt_chars}",
                                field, "prompt_too_long")
        check_name(value, field)

    def counts(self, num_prompts: int, n: int) -> None:
        """Prompts per request, and choices (prompts x n) per request."""
        if num_prompts > self.max_prompts_per_request:
            raise ProtocolError(f"the request has {num_prompts} prompts; the limit is "
                                f"{self.max_prompts_per_request}", "prompt")
        if num_prompts * n > self.max_choices_per_request:
            raise ProtocolError(f"the request asks for {num_prompts * n} choices (prompts x n); the limit "
                                f"is {self.max_choices_per_request}", "n")

    def stops(self, stop: Any, stop_token_ids: Any, field: str = "stop", ids_field: str = "stop_token_ids") -> None:
        """Counts and lengths of stop strings and stop ids. Also their types: ``/generate``
        gets them in a free-form dict, and this runs before SamplingParams looks at them."""
        if stop is not None and not isinstance(stop, (str, list)):
            raise ProtocolError(f"{field} must be a string or a list of strings, got {_json_type(stop)}", field)
        if stop_token_ids is not None and not isinstance(stop_token_ids, list):
            raise ProtocolError(f"{ids_field} must be a list of token ids, got {_json_type(stop_token_ids)}",
                                ids_field)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_strings:
            raise ProtocolError(f"{field} has {len(stops)} strings; the limit is {self.max_stop_strings}", field)
        for s in stops:
            if isinstance(s, str):
                if len(s) > self.max_stop_string_chars:
                    raise ProtocolError(f"{field}: a stop string has {len(s)} characters; the limit is "
                                        f"{self.max_stop_string_chars}", field)
                self.text(s, field)
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise ProtocolError(f"{ids_field} has {len(stop_token_ids)} entries; the limit is "
                                f"{self.max_stop_token_ids}", ids_field)
