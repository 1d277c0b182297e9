"""The ``X-Cache-Low-Priority-From`` header: from which token position what a request caches
is worth less than the rest.

``radixserve router`` sets it on a request whose prompt leaves, at that position, what its
family of earlier prompts shares (a system prompt, then this request's own question): the
question will not come again, and kept at normal priority it would age with the system
prompt and take it along when evicted (``radixserve.cache.radix``). Any client may send it;
it can only lower the priority of tokens its own request adds to the cache (a token another
request keeps at normal priority stays there). With the header, what the request computes
before that position (the part of the shared prefix it did not find cached) is kept on
probation: after every low token, before every normal one, until a later request finds it.
Positions count the prefix cache's keys: the prompt's token ids, each image placeholder
expanded to the image's tokens; a position past the prompt lowers nothing.
"""

from __future__ import annotations

from fastapi import Request

from radixserve.cache.base import check_low_priority_from
from radixserve.server.errors import APIError

HEADER = "x-cache-low-priority-from"

__all__ = ["HEADER", "request_low_priority_from"]


def request_low_priority_from(request: Request) -> int | None:
    """The header's position, or None without it; anything but ASCII digits (a number below
    2**63) is a 400 in OpenAI's error shape naming the header."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    name = "X-Cache-Low-Priority-From"
    try:
        text = raw.strip()
        # ASCII digits only: int() also takes "+1", "1_0" and other scripts' digits.
        value = int(text) if text.isascii() and text.isdigit() else raw
        return check_low_priority_from(value, name)
    except ValueError as e:
        raise APIError(400, str(e), param=name) from None
