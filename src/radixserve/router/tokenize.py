"""The router's view of a request: the token ids the worker will look up in its tree.

Routing by tokens needs exactly the ids the worker computes, so the router uses the
model's own tokenizer and chat template, and the server's own request models
(:mod:`radixserve.protocol`) to turn a chat body into a prompt. Only the tokenizer is
loaded, never the weights (:func:`load_tokenizer`).

A batch (several prompts in one body) is routed as a whole, by its first prompt.
"""

from __future__ import annotations

import base64
import binascii
from array import array
from typing import Any, Optional, Tuple

from radixserve.protocol.native import ImageInputSpec
from radixserve.model.tokenization.tokenizer import Tokenizer
from radixserve.placement.mirror import pack

__all__ = ["load_tokenizer", "RequestTokenizer"]


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of a model name/path (any alias, a ``.gguf`` file, a Hugging Face folder),
    without weights: the workers' API processes use the same
    :func:`radixserve.model.registry.load_tokenizer`, so both compute the same ids. Never
    installs a model package (ModelLoadError, a ValueError, saying how)."""
    from radixserve.model import registry

    return registry.load_tokenizer(name)


def _salt(body: dict) -> Optional[str]:
    """The request's own ``cache_salt`` (not yet the namespace: the worker narrows its
    tenant's by it, and so does :meth:`radixserve.router.fleet.Router.namespace`)."""
    s = body.get("cache_salt")
    return s if isinstance(s, str) and s else None


def _image_refs(path: str, body: dict) -> list[str]:
    """The image references of the request's (first) prompt, in order: chat ``image_url``
    parts, or ``/generate`` ``image_data``."""
    if path == "/v1/chat/completions":
        out = []
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "image_url":
                        url = part.get("image_url")
                        out.append(url.get("url") if isinstance(url, dict) else url)
        return out
    if path == "/generate":
        data = body.get("image_data")
        if data is None:
            return []
        if isinstance(data, str):
            return [data]
        first = data[0] if isinstance(data, list) and data else None
        if isinstance(body.get("text"), list) and isinstance(first, list):
            return list(first)  # a batch: the first prompt's images
        return list(data) if isinstance(data, list) else []
    return []


class RequestTokenizer:
    """Body (parsed JSON) of each generation endpoint -> ``(packed prompt ids, cache_salt)``.

    For a vision-language model (``vision``: the ``vision`` block of a worker's
    ``/get_model_info``) images in data URIs or base64 are decoded and hashed as the worker
    does, so the keys are the ones its tree holds (``radixserve.images``) and an image's
    questions go where it is cached; an image URL (fetched by the worker) keeps the prompt
    unexpanded, which routes by the text before it.

    Raises ValueError when the body has no usable prompt (the router then routes by load
    and lets the worker answer the error)."""

    def __init__(self, tokenizer: Tokenizer, vision: ImageInputSpec | None = None) -> None:
        self.tok = tokenizer
        self.vision = vision
        self._processor = None
        if vision:
            from radixserve.model.vision.vlm_config import ImageProcessorConfig

            self._processor = ImageProcessorConfig(**{k: tuple(x) if isinstance(x, list) else x
                                                      for k, x in vision.processor.items()})

    def has_images(self, body: dict) -> bool:
        return self.vision is not None and bool(body.get("messages") or body.get("image_data"))

    @staticmethod
    def is_batch(path: str, body: dict) -> bool:
        """Several prompts in one body (routed by the first: positions in it say nothing about the others)."""
        if path == "/v1/completions":
            p = body.get("prompt")
            return isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list))
        if path == "/generate":
            text, ids = body.get("text"), body.get("input_ids")
            return ((isinstance(text, list) and len(text) > 1)
                    or (isinstance(ids, list) and len(ids) > 1 and isinstance(ids[0], list)))
        return False

    def fetched_images(self, path: str, body: dict) -> bool:
        """An image the worker fetches itself (a URL): the router's prompt then lacks its
        tokens, so positions past it are not the worker's."""
        return self.vision is not None and any(
            isinstance(r, str) and r.startswith(("http://", "https://")) for r in _image_refs(path, body))

    def _with_images(self, packed: bytes, refs: list) -> bytes:
        """The packed prompt with each image placeholder expanded to its content keys."""
        if not refs or not self.vision:
            return packed
        from radixserve.images import keyed_prompt
        from radixserve.model.vision.image_processor import decode_image, image_content_hash

        digests = []
        for ref in refs:
            if not isinstance(ref, str) or ref.startswith(("http://", "https://")):
                return packed  # the worker fetches it: route by the text before it
            data = ref.split(",", 1)[1] if ref.startswith("data:") else ref
            try:
                raw = base64.b64decode(data, validate=False)
            except (binascii.Error, ValueError):
                return packed  # the worker answers the error
            digests.append(image_content_hash(decode_image(raw), self._processor))
        ids = array("I")
        ids.frombytes(packed)
        try:
            return pack(keyed_prompt(ids.tolist(), self.vision.image_token_id,
                                      self.vision.tokens_per_image, digests))
        except ValueError:
            return packed

    def _encode(self, p: Any, chat: bool = False) -> bytes:
        # As the worker's ServerContext.encode: raw text gets the model's BOS when its
        # tokenizer wants one; a rendered chat template has written it already.
        if isinstance(p, str):
            return pack(self.tok.encode(p) if chat else self.tok.encode_prompt(p))
        if isinstance(p, list) and all(type(t) is int and t >= 0 for t in p):
            return pack(p)
        raise ValueError("prompt must be a string or a list of token ids")

    def completion(self, body: dict) -> Tuple[bytes, Optional[str]]:
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # a batch: route by its first prompt
        return self._encode(p), _salt(body)

    def generate(self, body: dict) -> Tuple[bytes, Optional[str]]:
        text = body.get("text")
        if text is not None:
            p: Any = text[0] if isinstance(text, list) and text else text
        else:
            ids = body.get("input_ids")
            p = ids[0] if isinstance(ids, list) and ids and isinstance(ids[0], list) else ids
        return self._encode(p), _salt(body)

    def chat(self, body: dict) -> Tuple[bytes, Optional[str]]:
        from pydantic import ValidationError

        from radixserve.protocol.openai import ChatCompletionRequest

        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise ValueError(str(e)) from None
        msgs = req.template_messages(self.vision.image_token if self.vision else None)
        text = self.tok.apply_chat_template(
            msgs, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message)
        return self._encode(text, chat=True), _salt(body)

    def for_path(self, path: str, body: dict) -> Tuple[bytes, Optional[str]]:
        parse = {"/v1/chat/completions": self.chat, "/v1/completions": self.completion, "/generate": self.generate}
        if path not in parse:
            raise ValueError(f"no prompt in requests to {path}")
        packed, salt = parse[path](body)
        if self.vision:
            packed = self._with_images(packed, _image_refs(path, body))
        return packed, salt
