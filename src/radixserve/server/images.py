"""Images in requests: from a data URI, base64 or (when allowed) an http(s) URL to an
:class:`~radixserve.images.ImageInput` the engine core takes.

Everything here runs in the API process, off the event loop (``ServerContext.load_images``
runs :func:`load_image` on a pool of its own): decoding a large PNG takes real CPU time,
and the core must never parse untrusted image formats. Every input that costs memory or
time is bounded before the work it would cost: the number of images, the encoded bytes
(checked on the base64 length before decoding it, and while downloading), the pixels
(from the image header, before decompressing), and for URLs the time and the redirects.
Only common raster formats are opened (:data:`FORMATS`): Pillow knows formats whose
decoders are rarely exercised, or hand the data to external programs (EPS).

A bad image is the client's fault: :class:`APIError` 400 naming the field it came from
(``messages[0].content[1].image_url``, ``image_data[0]``).

Fetching URLs makes the server a client of whatever its clients name — including hosts
only the server can reach (a cloud's metadata service, an admin port on loopback). It is off
unless ``allow_image_urls``, and then reaches public addresses only: every address the host
name resolves to must be public (:class:`AddressPolicy`), the connection goes to an address
that was checked (a name that resolves elsewhere a moment later — DNS rebinding — changes
nothing), each redirect is checked the same way, and no proxy is used.
``allow_private_image_urls`` lifts the address check, for a server whose images live on its
own network.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any
from urllib.parse import urljoin, urlsplit

from radixserve.config import ServerConfig
from radixserve.engine.messages import VisionSpec
from radixserve.protocol.native import ImageInputSpec
from radixserve.images import ImageInput
from radixserve.model.vision.vlm_config import ImageProcessorConfig
from radixserve.server.errors import APIError

# Pillow format names opened for clients.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_READ_CHUNK = 1 << 16


_DEFAULTS = {f.name: f.default for f in fields(ServerConfig)}


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on the images of one request, and whether http(s) URLs are fetched: the
    :class:`~radixserve.config.ServerConfig` fields (``serve`` flags) of the same names, with
    its defaults. An image also counts against ``max_body_bytes`` (base64 inflates it by a third)."""

    max_images_per_request: int = _DEFAULTS["max_images_per_request"]
    max_image_bytes: int = _DEFAULTS["max_image_bytes"]
    max_image_pixels: int = _DEFAULTS["max_image_pixels"]
    allow_image_urls: bool = _DEFAULTS["allow_image_urls"]
    image_url_timeout_s: float = _DEFAULTS["image_url_timeout_s"]
    image_url_max_redirects: int = _DEFAULTS["image_url_max_redirects"]
    allow_private_image_urls: bool = _DEFAULTS["allow_private_image_urls"]

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
        for name in ("allow_image_urls", "allow_private_image_urls"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> "ImageLimits":
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})


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
    def from_spec(cls, v: VisionSpec | None, tokenizer: Any) -> "VisionInfo | None":
        """From the core's ``ModelInfo.vision`` (None: a text model). The processor dict
        crossed MessagePack, where tuples became lists."""
        if v is None:
            return None
        tid = v.image_token_id
        proc = ImageProcessorConfig(**{k: tuple(x) if isinstance(x, list) else x for k, x in v.processor.items()})
        text = tokenizer.id_to_token(tid) or tokenizer.decode([tid], skip_special_tokens=False)
        return cls(tid, text, v.tokens_per_image, proc)

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

    def spec(self) -> ImageInputSpec:
        """As ``/get_model_info`` tells it, for a router or frontend to key images the same way."""
        return ImageInputSpec(self.image_token_id, self.image_token, self.tokens_per_image, asdict(self.processor))


def no_images(field: str) -> APIError:
    return APIError(400, f"{field}: this model does not accept images", param=field, code="images_not_supported")


def check_count(n: int, limits: ImageLimits, field: str) -> None:
    if n > limits.max_images_per_request:
        raise APIError(400, f"{field}: the request has {n} images; the limit is "
                       f"{limits.max_images_per_request}", param=field, code="too_many_images")


# --------------------------------------------------------------------------- bytes of an image
def _too_big(field: str, limits: ImageLimits, what: str) -> APIError:
    return APIError(400, f"{field}: the image is {what}; the limit is {limits.max_image_bytes} bytes",
                    param=field, code="image_too_large")


def _invalid(field: str, why: str) -> APIError:
    return APIError(400, f"{field}: {why}", param=field, code="invalid_image")


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
            raise _invalid(field, "the image is not valid base64") from None
    if len(out) > limits.max_image_bytes:
        raise _too_big(field, limits, f"{len(out)} bytes")
    return out


def _data_uri(uri: str, field: str, limits: ImageLimits) -> bytes:
    head, comma, payload = uri.partition(",")
    if not comma:
        raise _invalid(field, "a data URI needs a comma before its data")
    params = head[len("data:"):].split(";")
    media = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise _invalid(field, "only base64 data URIs are supported (data:image/png;base64,...)")
    if media and not (media.startswith("image/") or media == "application/octet-stream"):
        raise _invalid(field, f"the data URI's media type {media!r} is not an image")
    return _b64(payload, field, limits)


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class AddressPolicy:
    """Which addresses an image URL may reach, and how a host name becomes addresses.

    Public (globally routable) unicast addresses only, unless ``allow_private``: not
    loopback, private, link-local (cloud metadata services live at 169.254.169.254),
    multicast, unspecified, reserved or otherwise non-global ranges; an IPv6 address that
    embeds an IPv4 one (mapped ``::ffff:a.b.c.d``, 6to4) is judged by the IPv4 address."""

    #: In the order they are reported (127.0.0.1 is "private" too: "loopback" says more).
    _KINDS = (("is_loopback", "loopback"), ("is_link_local", "link-local"), ("is_multicast", "multicast"),
              ("is_unspecified", "unspecified"), ("is_reserved", "reserved"), ("is_private", "private"))

    def __init__(self, allow_private: bool = False):
        self.allow_private = allow_private

    def refusal(self, ip: IPAddress) -> str | None:
        """Why ``ip`` may not be reached (its kind), or None."""
        if self.allow_private:
            return None
        if isinstance(ip, ipaddress.IPv6Address):
            ip = ip.ipv4_mapped or ip.sixtofour or ip
        for attr, kind in self._KINDS:
            if getattr(ip, attr):
                return kind
        return None if ip.is_global else "not global"

    def resolve(self, host: str, port: int) -> list[str]:
        """Every address ``host`` resolves to (OSError if none)."""
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


_REDIRECTS = (301, 302, 303, 307, 308)


def fetch_url(url: str, field: str, limits: ImageLimits, policy: AddressPolicy | None = None) -> bytes:
    """The body of ``url`` (blocking): at most ``max_image_bytes``, within about
    ``image_url_timeout_s`` overall, through at most ``image_url_max_redirects``, from
    addresses ``policy`` allows (by default: public ones, or any with
    ``allow_private_image_urls``)."""
    policy = policy if policy is not None else AddressPolicy(limits.allow_private_image_urls)
    deadline = time.monotonic() + limits.image_url_timeout_s

    def fail(why: str) -> APIError:
        return APIError(400, f"{field}: cannot fetch the image URL ({why})", param=field, code="image_fetch_failed")

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise fail(f"not received within {limits.image_url_timeout_s:g}s")
        return remaining

    try:
        for _ in range(limits.image_url_max_redirects + 1):
            conn = _connection(url, field, policy, left(), fail)
            try:
                parts = urlsplit(url)
                target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                conn.request("GET", target, headers={"User-Agent": "radixserve", "Accept": "image/*"})
                resp = conn.getresponse()
                if resp.status in _REDIRECTS:
                    location = resp.getheader("Location")
                    if not location:
                        raise fail(f"HTTP {resp.status} without a Location")
                    url = urljoin(url, location)
                    continue
                if resp.status != 200:
                    raise fail(f"HTTP {resp.status}: {resp.reason}")
                return _read_body(resp, field, limits, left)
            finally:
                conn.close()
        raise fail(f"more than {limits.image_url_max_redirects} redirects")
    except APIError:
        raise
    except (TimeoutError, OSError, ValueError, http.client.HTTPException) as e:
        raise fail(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None


def _connection(url: str, field: str, policy: AddressPolicy, timeout: float,
                fail: Any) -> http.client.HTTPConnection:
    """A connection for ``url`` that can only reach the addresses checked here."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise fail(f"only http(s) URLs are fetched, got {scheme or 'no scheme'!r}")
    host = parts.hostname
    if not host:
        raise fail("the URL names no host")
    port = parts.port or (443 if scheme == "https" else 80)
    try:
        addrs = policy.resolve(host, port)
    except OSError as e:
        raise fail(f"cannot resolve {host!r}: {e}") from None
    if not addrs:
        raise fail(f"cannot resolve {host!r}")
    for addr in addrs:
        why = policy.refusal(ipaddress.ip_address(addr.split("%")[0]))
        if why is not None:
            raise APIError(400, f"{field}: the image URL's host {host!r} is at {addr}, a {why} address; "
                           "this server fetches images from public addresses only "
                           "(--allow-private-image-urls lifts that)", param=field, code="image_url_forbidden")
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(host, port, timeout=timeout)  # Host header and TLS name: the URL's host

    def connect_checked(_address: Any, timeout: Any = None, source_address: Any = None) -> socket.socket:
        last: OSError | None = None
        for addr in addrs:  # never a fresh lookup: the addresses just checked
            try:
                return socket.create_connection((addr, port), timeout, source_address)
            except OSError as e:
                last = e
        raise last or OSError(f"cannot connect to {host!r}")

    conn._create_connection = connect_checked  # type: ignore[attr-defined]
    return conn


def _read_body(resp: http.client.HTTPResponse, field: str, limits: ImageLimits, left: Any) -> bytes:
    length = resp.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
        raise _too_big(field, limits, f"{length} bytes")
    buf = bytearray()
    while True:
        # What arrived: the deadline is checked per receive (a silent server trips the
        # socket's timeout, one that drips bytes trips this).
        chunk = resp.read1(_READ_CHUNK)
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limits.max_image_bytes:
            raise _too_big(field, limits, f"more than {limits.max_image_bytes} bytes")
        left()


def image_bytes(ref: str, field: str, limits: ImageLimits) -> bytes:
    """The encoded image a client's reference names: a data URI, an http(s) URL (when
    allowed) or, as SGLang's ``image_data`` takes it, bare base64."""
    if not isinstance(ref, str) or not ref.strip():
        raise _invalid(field, "an image must be a non-empty string (a data URI or base64)")
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
        raise _invalid(field, "unsupported URL scheme (send a data URI)")
    return _b64(ref, field, limits)


# --------------------------------------------------------------------------- pixels
def load_image(ref: str, field: str, limits: ImageLimits, vision: VisionInfo) -> ImageInput:
    """Bytes, decoded, preprocessed and hashed (blocking; run it off the event loop)."""
    from PIL import Image, UnidentifiedImageError

    from radixserve.model.vision.image_processor import decode_image, image_input

    data = image_bytes(ref, field, limits)
    try:  # the format, from the header alone, before Pillow tries every decoder it has
        with Image.open(io.BytesIO(data), formats=FORMATS):
            pass
    except Image.DecompressionBombError as e:
        raise APIError(400, f"{field}: {e}", param=field, code="image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise _invalid(field, f"not an image in a supported format ({', '.join(FORMATS)})") from None
    try:
        img = decode_image(data, limits.max_image_pixels)
        return image_input(img, vision.processor)
    except ValueError as e:
        code = "image_too_large" if "pixels" in str(e) else "invalid_image"
        raise APIError(400, f"{field}: {e}", param=field, code=code) from None


__all__ = ["AddressPolicy", "FORMATS", "ImageLimits", "VisionInfo", "check_count", "fetch_url", "image_bytes",
           "load_image", "no_images"]
