"""Images in prompts as the engine core sees them: preprocessed pixels and a content digest.

A request's prompt holds one image placeholder token per image; the core expands each to
the model's ``tokens_per_image`` positions (:func:`expand_prompt`). The prefix tree never
sees the placeholder id at those positions: :func:`span_keys` derives their keys from the
image's digest (a cryptographic hash of the decoded pixels and the preprocessing config,
``radixserve.model.vision.image_processor.image_content_hash``), so the same picture hits wherever it
appears, another picture never matches it, and the tenant salt of the tree keeps tenants
apart as it does for text. A match may end inside an image (the KV of an image's first
positions depends on those positions only, so a page-aligned or evicted-to-here match
reuses it exactly), but only after :data:`MIN_KEY_POSITIONS` of its positions: fewer would
trust a different image on fewer than 128 bits of key (:func:`clip_match`).

This module is the contract between the API side (decode, preprocess, hash) and the core
(keys, features); it imports no model code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Keys of image positions lie in [2**31, 2**32): never a vocabulary id (the tree's keys are
# uint32), 31 bits from the digest per position.
KEY_BASE = 1 << 31
# A match must cover this many of an image's positions (31 key bits each: >= 128 bits) or
# none of them.
MIN_KEY_POSITIONS = 5


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: ``digest`` (hex, of the pixels and the preprocessing) and the
    preprocessed ``pixel_values`` [3, H, W] float32 the vision tower reads."""

    digest: str
    pixel_values: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or len(self.digest) < 32:
            raise ValueError("image digest must be a hex string of at least 128 bits")
        int(self.digest, 16)  # ValueError unless hex
        pv = self.pixel_values
        if not isinstance(pv, torch.Tensor) or pv.dim() != 3 or pv.shape[0] != 3 or pv.dtype != torch.float32:
            shape = list(pv.shape) if isinstance(pv, torch.Tensor) else type(pv).__name__
            raise ValueError(f"image pixel_values must be a float32 [3, H, W] tensor, got {shape}")


@dataclass(frozen=True)
class ImageSpan:
    """Positions ``[offset, offset + length)`` of the prompt hold image ``index``'s features;
    ``key`` is what their tree keys derive from (the digest, or a per-request one when images
    are not to be shared)."""

    offset: int
    length: int
    index: int
    key: str

    @property
    def end(self) -> int:
        return self.offset + self.length


def expand_prompt(prompt_ids: Sequence[int], image_token_id: int, tokens_per_image: int,
                  keys: Sequence[str]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt with each placeholder repeated ``tokens_per_image`` times, and the spans of
    the images (``keys[i]`` for the i-th). ValueError unless there is exactly one
    placeholder per image."""
    n = sum(1 for t in prompt_ids if t == image_token_id)
    if n != len(keys):
        raise ValueError(f"the prompt holds {n} image placeholder token(s) (id {image_token_id}) "
                         f"but {len(keys)} image(s) were given")
    out: list[int] = []
    spans: list[ImageSpan] = []
    for t in prompt_ids:
        if t == image_token_id:
            spans.append(ImageSpan(len(out), tokens_per_image, len(spans), keys[len(spans)]))
            out.extend([image_token_id] * tokens_per_image)
        else:
            out.append(t)
    return out, tuple(spans)


def span_keys(key: str, length: int) -> list[int]:
    """The tree keys of an image's ``length`` positions: 31 bits each of a hash of
    ``(key, position)``, in ``[KEY_BASE, 2**32)``."""
    out: list[int] = []
    seed = key.encode()
    j = 0
    while len(out) < length:
        block = hashlib.blake2b(seed + j.to_bytes(8, "little"), digest_size=64).digest()
        for i in range(0, 64, 4):
            if len(out) == length:
                break
            out.append(KEY_BASE | (int.from_bytes(block[i:i + 4], "little") & (KEY_BASE - 1)))
        j += 1
    return out


def keyed_prompt(prompt_ids: Sequence[int], image_token_id: int, tokens_per_image: int,
                 keys: Sequence[str]) -> list[int]:
    """The prompt's tree keys as the core derives them (``Req.cache_key``): expanded, each
    image's positions holding its :func:`span_keys` (for routers that predict where a
    prompt is cached). ValueError as :func:`expand_prompt`."""
    ids, spans = expand_prompt(prompt_ids, image_token_id, tokens_per_image, keys)
    for sp in spans:
        ids[sp.offset:sp.end] = span_keys(sp.key, sp.length)
    return ids


def clip_match(length: int, spans: Sequence[ImageSpan]) -> int:
    """``length`` cached tokens, cut back to the start of an image the match ends inside
    after fewer than :data:`MIN_KEY_POSITIONS` of its positions."""
    for sp in spans:
        if sp.offset < length < sp.end and length - sp.offset < MIN_KEY_POSITIONS:
            return sp.offset
    return length


def image_tokens_in(length: int, spans: Sequence[ImageSpan]) -> int:
    """How many of the first ``length`` positions are image positions."""
    return sum(max(0, min(length, sp.end) - sp.offset) for sp in spans)
