"""Whether a request can ever run: the context window and the KV pool bound every request.

A module of its own because two processes ask: the engine core, and the API process, which
checks before streaming starts.
"""

from __future__ import annotations


def check_fits(prompt_len: int, max_tokens: int, max_context_len: int, kv_capacity: int,
               page_size: int) -> None:
    """ValueError unless a prompt of ``prompt_len`` tokens with ``max_tokens`` to generate
    fits the context window and can ever fit the KV pool."""
    if prompt_len >= max_context_len:
        raise ValueError(f"prompt has {prompt_len} tokens; the context length is {max_context_len}")
    if prompt_len + max_tokens > max_context_len:
        raise ValueError(f"max_tokens ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the "
                         f"context length {max_context_len}")
    if prompt_len + 1 > kv_capacity - page_size:
        raise ValueError(f"prompt has {prompt_len} tokens; the KV pool holds {kv_capacity} (raise kv_cache_tokens)")
