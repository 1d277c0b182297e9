"""Images into vision-tower input, and the content hash that keys an image in the cache.

:func:`preprocess` repeats transformers' ``CLIPImageProcessor`` (its Pillow backend, which
is also what the torchvision one is checked against) step for step, so the pixel values are
the same floats: RGB conversion with alpha composited onto white, optional pad to square
(``LlavaImageProcessor``), a Pillow resize of the uint8 image, center crop (zero-padded when
the image is smaller), rescale in float64 then float32, normalise in float32. Only Pillow
and torch are used (torchvision is not a dependency).

:func:`image_content_hash` identifies an image by what the model will see: a SHA-256 over
the decoded RGB pixels (mode, size, bytes) and the preprocessing config. The same pixels
sent as another PNG compression level, another lossless format or another data URI hash the
same; one changed pixel, or another preprocessing, hashes differently. SHA-256 rather than a
faster non-cryptographic hash because two images that collide would share KV across
requests (a leak), and rather than blake3 because keys must be the same on every server
that shares a storage tier, whatever is installed there.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence

import torch
from PIL import Image

from radixserve.images import ImageInput
from radixserve.model.vision.vlm_config import ImageProcessorConfig

HASH_DOMAIN = b"radixserve-image-v1\0"


def decode_image(data: bytes, max_pixels: int = 64_000_000) -> Image.Image:
    """Decode encoded image bytes (PNG, JPEG, ...) fully; ValueError if they are not an image
    or hold more than ``max_pixels`` pixels (checked from the header, before decoding)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"image data must be bytes, got {type(data).__name__}")
    try:
        img = Image.open(io.BytesIO(bytes(data)))
        w, h = img.size
        if w * h > max_pixels:
            raise ValueError(f"image has {w}x{h} = {w * h} pixels, more than the limit {max_pixels}")
        img.load()
    except ValueError:
        raise
    except (OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"image data cannot be decoded ({e})") from e
    return img


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band or a palette/tRNS transparent colour)
    composited onto white, as transformers' ``convert_to_rgb`` does."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"image must be a PIL.Image.Image, got {type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _resize_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) after the resize: transformers' ``get_resize_output_image_size`` with
    ``default_to_square=False`` (the short side to ``shortest_edge``, the long one truncated)."""
    if cfg.size is not None:
        return cfg.size
    assert cfg.shortest_edge is not None  # checked by ImageProcessorConfig
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _pad_to_square(image: Image.Image, mean: Sequence[float]) -> Image.Image:
    w, h = image.size
    if w == h:
        return image
    side = max(w, h)
    out = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    out.paste(image, ((side - w) // 2, (side - h) // 2))
    return out


def _center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[C, H, W] cropped around the centre; zero-padded first where the image is smaller
    (transformers' ``center_crop``, offsets included)."""
    _, h, w = x.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return x[:, top : top + height, left : left + width]
    nh, nw = max(height, h), max(width, w)
    padded = x.new_zeros((x.shape[0], nh, nw))
    tp, lp = -(-(nh - h) // 2), -(-(nw - w) // 2)  # ceil
    padded[:, tp : tp + h, lp : lp + w] = x
    top, left = top + tp, left + lp
    return padded[:, max(0, top) : min(nh, top + height), max(0, left) : min(nw, left + width)]


def _pixels(image: Image.Image) -> torch.Tensor:
    """uint8 [C, H, W] of an RGB image."""
    w, h = image.size
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)


def preprocess_one(image: Image.Image, cfg: ImageProcessorConfig) -> torch.Tensor:
    """float32 [3, H, W] pixel values of one image (see the module docstring)."""
    img = to_rgb(image)
    if cfg.do_pad:
        img = _pad_to_square(img, cfg.image_mean)
    if cfg.do_resize:
        h, w = _resize_size(img.height, img.width, cfg)
        img = img.resize((w, h), resample=cfg.resample)
    x = _pixels(img)
    if cfg.do_center_crop:
        x = _center_crop(x, *cfg.crop_size)
    if cfg.do_rescale:
        y = (x.to(torch.float64) * cfg.rescale_factor).to(torch.float32)
    else:
        y = x.to(torch.float32)
    if cfg.do_normalize:
        mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(cfg.image_std, dtype=torch.float32).view(3, 1, 1)
        y = (y - mean) / std
    return y.contiguous()


def preprocess(images: Sequence[Image.Image], cfg: ImageProcessorConfig) -> torch.Tensor:
    """float32 [N, 3, H, W] pixel values of ``images`` (all the same output size: the crop)."""
    if not images:
        raise ValueError("images must not be empty")
    out = [preprocess_one(im, cfg) for im in images]
    shapes = {tuple(t.shape) for t in out}
    if len(shapes) != 1:
        raise ValueError(f"images preprocess to different sizes {sorted(shapes)}: the processor "
                         "config has no center crop or exact resize")
    return torch.stack(out)


def image_content_hash(image: Image.Image, cfg: ImageProcessorConfig) -> str:
    """Hex SHA-256 identifying ``image`` as model input: the RGB pixels (mode, size, bytes)
    and the preprocessing config (see the module docstring)."""
    rgb = to_rgb(image)
    h = hashlib.sha256(HASH_DOMAIN)
    meta = f"{rgb.mode};{rgb.width}x{rgb.height};{cfg.canonical()}".encode()
    h.update(len(meta).to_bytes(8, "little"))
    h.update(meta)
    h.update(rgb.tobytes())
    return h.hexdigest()


def image_input(image: "Image.Image | bytes | ImageInput", cfg: ImageProcessorConfig,
                max_pixels: int = 64_000_000) -> ImageInput:
    """What the engine core takes for one image: a PIL image or encoded bytes (decoded),
    preprocessed and hashed; an :class:`ImageInput` passes through."""
    if isinstance(image, ImageInput):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = decode_image(image, max_pixels)
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL image, encoded bytes or an ImageInput, got {type(image).__name__}")
    rgb = to_rgb(image)
    return ImageInput(image_content_hash(rgb, cfg), preprocess_one(rgb, cfg))
