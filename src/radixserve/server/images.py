"""Images in requests: from a data URI, base64 or (when allowed) an http(s) URL to an
:class:`~radixserve.images.ImageInput` the engine core takes.

Everything here runs in the API process, off the event loop (``ServerState.load_images``
runs :func:`load_image` on the tokenize pool): decoding a large PNG takes real CPU time,
and the core must never parse untrusted image formats. Every input that costs memory or
time is bounded before the work it would cost: the number of images, the encoded bytes
(checked on the base64 length before decoding it, and while downloading), the pixels
(from the image header, before decompressing), and for URLs the time and the redirects.
Only common raster formats are opened (:data:`FORMATS`): Pillow knows formats whose
decoders are rarely exercised, or hand the data to external programs (EPS).

A bad image is the client's fault: :class:`APIError` 400 naming the field it came from
(``messages[0].content[1].image_url``, ``image_data[0]``).

Fetching URLs makes the server a client of whatever its clients name — including hosts
only the server can reach. It is off unless ``allow_image_urls``; enable it only where the
server's network holds nothing a client must not reach.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from radixserve.config import ServerConfig
from radixserve.images import ImageInput
from radixserve.model.vlm_config import ImageProcessorConfig
from radixserve.server.errors import APIError

# Pillow format names opened for clients.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_READ_CHUNK = 1 << 16


_DEFAULTS = {f.name: f.default for f in fields(ServerConfig)}


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on the images of one request, and whether http(s) URLs are fetched.

    :meth:`from_config` takes the fields of the same names from
    :class:`~radixserve.config.ServerConfig` (the ``serve`` flags). An image also counts
    against ``max_body_bytes`` (base64 inflates it by a third)."""

    # The defaults are ServerConfig's (one place for them).
    max_images_per_request: int = _DEFAULTS["max_images_per_request"]
    max_image_bytes: int = _DEFAULTS["max_image_bytes"]
    max_image_pixels: int = _DEFAULTS["max_image_pixels"]
    allow_image_urls: bool = _DEFAULTS["allow_image_urls"]
    image_url_timeout_s: float = _DEFAULTS["image_url_timeout_s"]
    image_url_max_redirects: int = _DEFAULTS["image_url_max_redirects"]

    def __post_init__(self) -> None:
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        r = self.image_url_max_redirects
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"image_url_max_redirects must be an int >= 0, got {r!r}")
        t = self.image_url_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 600:
            raise ValueError(f"image_url_timeout_s must be in (0, 600], got {t!r}")
        if not isinstance(self.allow_image_urls, bool):
            raise ValueError(f"allow_image_urls must be a bool, got {self.allow_image_urls!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> "ImageLimits":
        given = {f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)}
        return cls(**given)


@dataclass(frozen=True)
class VisionInfo:
    """What the API side needs of a vision-language model: its placeholder token (id and
    text, as the chat template text carries it), how many positions an image takes, and the
    preprocessing (so the digest computed here is the one the core's cache keys use)."""

    image_token_id: int
    image_token: str
    tokens_per_image: int
    processor: ImageProcessorConfig

    @classmethod
    def from_info(cls, info: dict[str, Any], tokenizer: Any) -> "VisionInfo | None":
        """From the core's ``model_info()["vision"]`` (None: a text model). The processor
        dict crossed MessagePack, where tuples became lists."""
        v = info.get("vision")
        if not v:
            return None
        tid = int(v["image_token_id"])
        proc = ImageProcessorConfig(**{k: tuple(x) if isinstance(x, list) else x
                                       for k, x in v["processor"].items()})
        text = tokenizer.id_to_token(tid) or tokenizer.decode([tid], skip_special_tokens=False)
        return cls(tid, text, int(v["tokens_per_image"]), proc)

    def prompt_len(self, ids: Sequence[int], n_images: int) -> int:
        """Length of the prompt once the core expanded each placeholder."""
        return len(ids) + n_images * (self.tokens_per_image - 1)

    def check_placeholders(self, ids: Sequence[int], n_images: int, field: str) -> None:
        """400 unless the prompt holds exactly one placeholder per image."""
        n = sum(1 for t in ids if t == self.image_token_id)
        if n != n_images:
            raise APIError(400, f"{field}: the prompt holds {n} image placeholder(s) "
                           f"({self.image_token!r}) but the request has {n_images} image(s); each "
                           f"image needs exactly one {self.image_token!r} where it goes",
                           param=field, code="image_placeholder_mismatch")

    def as_dict(self) -> dict[str, Any]:
        return {"image_token_id": self.image_token_id, "image_token": self.image_token,
                "tokens_per_image": self.tokens_per_image, "processor": asdict(self.processor)}


def no_images(field: str) -> APIError:
    return APIError(400, f"{field}: this model does not accept images", param=field,
                    code="images_not_supported")


def check_count(n: int, limits: ImageLimits, field: str) -> None:
    if n > limits.max_images_per_request:
        raise APIError(400, f"{field}: the request has {n} images; the limit is "
                       f"{limits.max_images_per_request}", param=field, code="too_many_images")


# --------------------------------------------------------------------------- bytes of an image
def _too_big(field: str, limits: ImageLimits, what: str) -> APIError:
    return APIError(400, f"{field}: the image is {what}; the limit is {limits.max_image_bytes} bytes",
                    param=field, code="image_too_large")


_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=")


def _b64(data: str, field: str, limits: ImageLimits) -> bytes:
    s = "".join(data.split())  # line-wrapped base64 (MIME style) is common
    if len(s) // 4 * 3 > limits.max_image_bytes + 2:
        raise _too_big(field, limits, f"about {len(s) // 4 * 3} bytes")
    try:
        out = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        try:  # the URL-safe alphabet, as some clients send it
            out = base64.urlsafe_b64decode(s) if s and set(s) <= _URLSAFE else b""
        except (binascii.Error, ValueError):
            out = b""
        if not out:
            raise APIError(400, f"{field}: the image is not valid base64", param=field,
                           code="invalid_image") from None
    if len(out) > limits.max_image_bytes:
        raise _too_big(field, limits, f"{len(out)} bytes")
    return out


def _data_uri(uri: str, field: str, limits: ImageLimits) -> bytes:
    head, comma, payload = uri.partition(",")
    if not comma:
        raise APIError(400, f"{field}: a data URI needs a comma before its data", param=field,
                       code="invalid_image")
    params = head[len("data:"):].split(";")
    media = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise APIError(400, f"{field}: only base64 data URIs are supported "
                       "(data:image/png;base64,...)", param=field, code="invalid_image")
    if media and not (media.startswith("image/") or media == "application/octet-stream"):
        raise APIError(400, f"{field}: the data URI's media type {media!r} is not an image",
                       param=field, code="invalid_image")
    return _b64(payload, field, limits)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """At most ``n`` redirects, and only to http(s)."""

    def __init__(self, n: int):
        self.max_redirections = n

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:
        if urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a non-http(s) URL", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_url(url: str, field: str, limits: ImageLimits) -> bytes:
    """The body of ``url`` (blocking): at most ``max_image_bytes``, within about
    ``image_url_timeout_s`` overall, through at most ``image_url_max_redirects``."""
    opener = urllib.request.build_opener(_Redirects(limits.image_url_max_redirects))
    req = urllib.request.Request(url, headers={"User-Agent": "radixserve", "Accept": "image/*"})
    deadline = time.monotonic() + limits.image_url_timeout_s

    def fail(why: str) -> APIError:
        return APIError(400, f"{field}: cannot fetch the image URL ({why})", param=field,
                        code="image_fetch_failed")

    try:
        with opener.open(req, timeout=limits.image_url_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
                raise _too_big(field, limits, f"{length} bytes")
            buf = bytearray()
            while True:
                chunk = resp.read1(_READ_CHUNK)  # what arrived: the deadline is checked per receive
                if not chunk:
                    break
                buf += chunk
                if len(buf) > limits.max_image_bytes:
                    raise _too_big(field, limits, f"more than {limits.max_image_bytes} bytes")
                if time.monotonic() > deadline:
                    raise fail(f"not received within {limits.image_url_timeout_s:g}s")
            return bytes(buf)
    except APIError:
        raise
    except urllib.error.HTTPError as e:
        raise fail(f"HTTP {e.code}: {e.reason}") from None
    except urllib.error.URLError as e:
        raise fail(str(e.reason)) from None
    except (TimeoutError, OSError, ValueError) as e:
        raise fail(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None


def image_bytes(ref: str, field: str, limits: ImageLimits) -> bytes:
    """The encoded image a client's reference names: a data URI, an http(s) URL (when
    allowed) or, as SGLang's ``image_data`` takes it, bare base64."""
    if not isinstance(ref, str) or not ref.strip():
        raise APIError(400, f"{field}: an image must be a non-empty string (a data URI or base64)",
                       param=field, code="invalid_image")
    ref = ref.strip()
    low = ref[:8].lower()
    if low.startswith("data:"):
        return _data_uri(ref, field, limits)
    if low.startswith(("http://", "https://")):
        if not limits.allow_image_urls:
            raise APIError(400, f"{field}: this server does not fetch image URLs; send the image "
                           "as a data URI (data:image/png;base64,...)", param=field,
                           code="image_urls_disabled")
        return fetch_url(ref, field, limits)
    if "://" in ref[:16]:
        raise APIError(400, f"{field}: unsupported URL scheme (send a data URI)", param=field,
                       code="invalid_image")
    return _b64(ref, field, limits)


# --------------------------------------------------------------------------- pixels
def load_image(ref: str, field: str, limits: ImageLimits, vision: VisionInfo) -> ImageInput:
    """Bytes, decoded, preprocessed and hashed (blocking; run it off the event loop)."""
    from PIL import Image, UnidentifiedImageError

    from radixserve.model.image_processor import decode_image, image_input

    data = image_bytes(ref, field, limits)
    try:  # the format, from the header alone, before Pillow tries every decoder it has
        with Image.open(io.BytesIO(data), formats=FORMATS):
            pass
    except Image.DecompressionBombError as e:
        raise APIError(400, f"{field}: {e}", param=field, code="image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise APIError(400, f"{field}: not an image in a supported format ({', '.join(FORMATS)})",
                       param=field, code="invalid_image") from None
    try:
        img = decode_image(data, limits.max_image_pixels)
        return image_input(img, vision.processor)
    except ValueError as e:
        code = "image_too_large" if "pixels" in str(e) else "invalid_image"
        raise APIError(400, f"{field}: {e}", param=field, code=code) from None


__all__ = ["FORMATS", "ImageLimits", "VisionInfo", "check_count", "fetch_url", "image_bytes",
           "load_image", "no_images"]
