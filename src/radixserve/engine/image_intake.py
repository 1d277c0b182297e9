"""A vision-language request at the engine core's door: its images checked and its prompt
expanded, one placeholder per image into the image's token positions.

The API process decodes and preprocesses images; the core still checks what arrives (type
and pixel shape), so bad input raises ValueError at ``add_request`` before it can reach a
forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.images import ImageInput, ImageSpan, expand_prompt
from radixserve.model.vision.vlm_config import VisionParts


def expand_images(vision: VisionParts | None, rid: str, prompt_ids: Sequence[int],
                  images: Sequence[ImageInput] | None, *, model: str, content_keys: bool,
                  ) -> tuple[Sequence[int], tuple[ImageSpan, ...], tuple[ImageInput, ...]]:
    """(prompt with each image placeholder expanded, image spans, images); ValueError for
    images on a text model (``model`` names it), a placeholder count that differs from the
    images', or an image the vision tower cannot read. Without ``content_keys`` every
    request's images are its own (keyed by ``rid`` too): never shared."""
    if vision is None:
        if images:
            raise ValueError(f"images: model {model!r} does not accept images")
        return prompt_ids, (), ()
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    images = list(images or ())
    vc = vision.config
    size = vc.vision.image_size
    for i, im in enumerate(images):
        if not isinstance(im, ImageInput):
            raise ValueError(f"images[{i}] must be an ImageInput, got {type(im).__name__}")
        if tuple(im.pixel_values.shape) != (3, size, size):
            raise ValueError(f"images[{i}]: pixel_values must be [3, {size}, {size}] for this model, "
                             f"got {list(im.pixel_values.shape)}")
    keys = [im.digest if content_keys else f"{im.digest}:{rid}" for im in images]
    if not isinstance(prompt_ids, (list, tuple)):
        raise ValueError("prompt token ids must be a list of integers")
    ids, spans = expand_prompt(prompt_ids, vc.image_token_id, vc.tokens_per_image, keys)
    return ids, spans, tuple(images)


def vision_info(vision: VisionParts | None) -> dict[str, Any] | None:
    """What the API side needs to turn images into :class:`ImageInput` (None: text model)."""
    if vision is None:
        return None
    return {"image_token_id": vision.config.image_token_id,
            "tokens_per_image": vision.config.tokens_per_image,
            "processor": dataclasses.asdict(vision.processor)}
