"""The router's view of a request: the token ids the worker will look up in its tree.

Routing by tokens needs exactly the ids the worker computes, so the router uses the
model's own tokenizer and chat template, and the server's own request models
(:mod:`radixserve.protocol`) to turn a chat body into a prompt. Only the tokenizer is
loaded, never the weights (:func:`load_tokenizer`).

A batch (several prompts in one body) is routed as a whole, by its first prompt.
"""

from __future__ import annotations

from array import array
from typing import Any, Hashable, Tuple

from radixserve.model.tokenizer import Tokenizer

__all__ = ["load_tokenizer", "RequestTokenizer"]


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of a model name/path as :func:`radixserve.model.registry.load_model`
    understands it (every alias: ``smollm2-135m``, ``gemma3-270m``, ``tiny-random``; a
    ``.gguf`` file; a Hugging Face folder), without loading weights: the same
    :func:`radixserve.model.registry.load_tokenizer` the workers' API processes use, so
    both compute the same ids. Never installs a model package (ModelLoadError, a
    ValueError, saying how)."""
    from radixserve.model import registry

    return registry.load_tokenizer(name)


def _pack(ids: Any) -> bytes:
    a = array("I")
    a.fromlist(ids)
    return a.tobytes()


def _salt(body: dict) -> Hashable:
    s = body.get("cache_salt")
    return s if isinstance(s, str) and s else None


class RequestTokenizer:
    """Body (parsed JSON) of each generation endpoint -> ``(packed prompt ids, salt)``.

    Raises ValueError when the body has no usable prompt (the router then routes by load
    and lets the worker answer the error)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer

    def _encode(self, p: Any, chat: bool = False) -> bytes:
        # As the worker's ServerState.encode: raw text gets the model's BOS when its
        # tokenizer wants one; a rendered chat template has written it already.
        if isinstance(p, str):
            return _pack(self.tok.encode(p) if chat else self.tok.encode_prompt(p))
        if isinstance(p, list) and all(type(t) is int and t >= 0 for t in p):
            return _pack(p)
        raise ValueError("prompt must be a string or a list of token ids")

    def completion(self, body: dict) -> Tuple[bytes, Hashable]:
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # a batch: route by its first prompt
        return self._encode(p), _salt(body)

    def generate(self, body: dict) -> Tuple[bytes, Hashable]:
        text = body.get("text")
        if text is not None:
            p: Any = text[0] if isinstance(text, list) and text else text
        else:
            ids = body.get("input_ids")
            p = ids[0] if isinstance(ids, list) and ids and isinstance(ids[0], list) else ids
        return self._encode(p), _salt(body)

    def chat(self, body: dict) -> Tuple[bytes, Hashable]:
        from pydantic import ValidationError

        from radixserve.protocol import ChatCompletionRequest

        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise ValueError(str(e)) from None
        msgs = req.template_messages()
        text = self.tok.apply_chat_template(
            msgs, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message)
        return self._encode(text, chat=True), _salt(body)

    def for_path(self, path: str, body: dict) -> Tuple[bytes, Hashable]:
        if path == "/v1/chat/completions":
            return self.chat(body)
        if path == "/v1/completions":
            return self.completion(body)
        if path == "/generate":
            return self.generate(body)
        raise ValueError(f"no prompt in requests to {path}")
