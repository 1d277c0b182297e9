"""Images in prompts over HTTP (issue 25, API part).

Unit level: the wire form of an image (raw float32 bytes through MessagePack), data URIs and
base64, URL fetching with its limits (a local http.server), the chat content parts, SGLang's
``image_data`` shapes. End to end: a real uvicorn server on tiny-random-llava driven by the
``openai`` client and httpx — the same image asked about again is served from the cache,
also as another PNG encoding of the same pixels; one changed pixel misses; bad images are
400s naming the field and the server keeps serving; a text model refuses image parts.
"""

from __future__ import annotations

import base64
import http.server
import io
import ipaddress
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
import torch
from PIL import Image

from radixserve.engine.client import Submission, cache_key_tokens, shown_prompt
from radixserve.engine.messages import (AddRequest, ImagePayload, ModelInfo, VisionSpec, command_decoder,
                                        command_encoder, images_from_wire, images_to_wire)
from radixserve.images import ImageInput, span_keys
from radixserve.model.vision.vlm_config import ImageProcessorConfig
from radixserve.protocol import ChatCompletionRequest, GenerateRequest
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import APIError
from radixserve.config import ServerConfig
from radixserve.server.images import AddressPolicy, ImageLimits, VisionInfo, fetch_url, image_bytes, load_image

from server_utils import ServerHandle, start_server

VLM = "tiny-random-llava"
TOKENS_PER_IMAGE = 25  # 30x30 crop in 6x6 patches, CLS dropped
CFG = ImageProcessorConfig(crop_size=(30, 30), shortest_edge=30)
VISION = VisionInfo(519, "<image>", TOKENS_PER_IMAGE, CFG)


# --------------------------------------------------------------------------- helpers
def noise_image(seed: int, size: tuple[int, int] = (40, 32)) -> Image.Image:
    rng = random.Random(seed)
    w, h = size
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(w * h * 3)))


def png(img: Image.Image, compress_level: int = 6) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG", compress_level=compress_level)
    return b.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def chat_body(*parts: dict[str, Any], max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
    return {"model": VLM, "messages": [{"role": "user", "content": list(parts)}],
            "max_tokens": max_tokens, "temperature": 0, **kw}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_400(r: httpx.Response, param: str, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# --------------------------------------------------------------------------- the wire
def test_image_payload_round_trip_is_exact_and_binary() -> None:
    pv = torch.randn(3, 30, 30, generator=torch.Generator().manual_seed(0))
    im = ImageInput("ab" * 32, pv)
    cmd = AddRequest("r1", [1, 519, 2], SamplingParams(max_tokens=3), images=images_to_wire([im]))
    raw = command_encoder().encode([cmd])
    # Pixels travel as one bin blob: about 4 bytes per float, not a MessagePack float each (9).
    assert len(raw) < 4 * pv.numel() + 1000
    (back,) = command_decoder().decode(raw)
    assert isinstance(back, AddRequest)
    (got,) = images_from_wire(back.images)
    assert got.digest == im.digest and got.pixel_values.shape == (3, 30, 30)
    assert torch.equal(got.pixel_values, pv)
    # A text request carries no images (and old-shaped messages still decode).
    plain = command_decoder().decode(command_encoder().encode([AddRequest("r2", [1], SamplingParams())]))[0]
    assert plain.images == [] and images_from_wire(plain.images) is None


def test_image_payload_refuses_a_shape_that_does_not_match() -> None:
    with pytest.raises(ValueError, match="bytes of pixels"):
        ImagePayload("ab" * 32, (3, 30, 30), b"\0" * 12).to_image()
    with pytest.raises(ValueError, match="shape"):
        ImagePayload("ab" * 32, (3, 0, 30), b"").to_image()
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["ab", [3, 30], b""]), type=ImagePayload)


def test_submission_prompt_counts_and_routing_keys_follow_the_expansion() -> None:
    info = ModelInfo(model="m", arch=None, vocab_size=1024, max_context_len=64, eos_ids=[], kv_capacity_tokens=64,
                     max_running_requests=1, page_size=1, dtype="float32", kv_cache_dtype="float32", tp_size=1,
                     vision=VisionSpec(image_token_id=519, tokens_per_image=4, processor={}))
    ims = (ImageInput("cd" * 32, torch.zeros(3, 2, 2)),)
    sub = Submission("r", [7, 519, 8], SamplingParams(), images=ims)
    assert shown_prompt(sub, info) == [7, 519, 519, 519, 519, 8]
    assert cache_key_tokens(sub, info) == [7, *span_keys("cd" * 32, 4), 8]
    # Text requests and text models: the ids as they are.
    assert shown_prompt(Submission("t", [7, 8], SamplingParams()), info) == [7, 8]
    assert cache_key_tokens(sub, None) == [7, 519, 8]


# --------------------------------------------------------------------------- bytes of images
def test_data_uris_and_bare_base64() -> None:
    limits = ImageLimits()
    data = png(noise_image(1))
    assert image_bytes(data_uri(data), "f", limits) == data
    assert image_bytes(base64.b64encode(data).decode(), "f", limits) == data
    wrapped = base64.encodebytes(data).decode()  # MIME line breaks
    assert image_bytes(wrapped, "f", limits) == data
    assert image_bytes(base64.urlsafe_b64encode(data).decode(), "f", limits) == data
    assert image_bytes(data_uri(data, "application/octet-stream"), "f", limits) == data


@pytest.mark.parametrize("ref,code", [
    ("data:image/png;base64,@@@not base64@@@", "invalid_image"),
    ("data:image/png,rawbytes", "invalid_image"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image"),
    ("data:image/png;base64", "invalid_image"),
    ("!!!", "invalid_image"),
    ("", "invalid_image"),
    ("file:///etc/passwd", "invalid_image"),
    ("https://example.com/cat.png", "image_urls_disabled"),
])
def test_bad_image_references(ref: str, code: str) -> None:
    with pytest.raises(APIError) as e:
        image_bytes(ref, "messages[0].content[1].image_url", ImageLimits())
    assert e.value.status == 400 and e.value.code == code
    assert e.value.param == "messages[0].content[1].image_url"


def test_byte_limit_is_checked_before_decoding() -> None:
    limits = ImageLimits(max_image_bytes=1000)
    with pytest.raises(APIError) as e:
        image_bytes(data_uri(b"\0" * 5000), "image_data", limits)
    assert e.value.code == "image_too_large" and e.value.param == "image_data"


def test_load_image_hashes_pixels_not_encodings() -> None:
    limits = ImageLimits()
    img = noise_image(2)
    a = load_image(data_uri(png(img, 1)), "f", limits, VISION)
    b = load_image(data_uri(png(img, 9)), "f", limits, VISION)
    bmp = io.BytesIO()
    img.save(bmp, "BMP")
    c = load_image(data_uri(bmp.getvalue(), "image/bmp"), "f", limits, VISION)
    assert png(img, 1) != png(img, 9)
    assert a.digest == b.digest == c.digest
    assert a.pixel_values.shape == (3, 30, 30) and torch.equal(a.pixel_values, b.pixel_values)
    changed = img.copy()
    changed.putpixel((0, 0), tuple((v + 1) % 256 for v in img.getpixel((0, 0))))
    assert load_image(data_uri(png(changed)), "f", limits, VISION).digest != a.digest


def test_load_image_refuses_non_images_and_too_many_pixels() -> None:
    with pytest.raises(APIError) as e:
        load_image(data_uri(b"GIF89a but not really an image at all"), "image_data[0]", ImageLimits(), VISION)
    assert e.value.code == "invalid_image" and e.value.param == "image_data[0]"
    truncated = png(noise_image(3))[:60]
    with pytest.raises(APIError) as e:
        load_image(data_uri(truncated), "f", ImageLimits(), VISION)
    assert e.value.code == "invalid_image"
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"  # never handed to Pillow's EPS plugin
    with pytest.raises(APIError, match="supported format"):
        load_image(data_uri(eps, ""), "f", ImageLimits(), VISION)
    with pytest.raises(APIError) as e:
        load_image(data_uri(png(noise_image(4, (40, 30)))), "f", ImageLimits(max_image_pixels=1000), VISION)
    assert e.value.code == "image_too_large" and "pixels" in e.value.message


def test_limits_from_a_server_config() -> None:
    class Cfg:
        max_images_per_request = 2
        allow_image_urls = True
        port = 1

    lim = ImageLimits.from_config(Cfg())
    assert lim.max_images_per_request == 2 and lim.allow_image_urls and lim.max_image_bytes == 20 * 2**20
    with pytest.raises(ValueError, match="max_image_bytes"):
        ImageLimits(max_image_bytes=0)


# --------------------------------------------------------------------------- URLs
class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, Any] = {}
    served: list[str] = []  # every path asked for, in order

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.served.append(self.path)
        what = self.routes.get(self.path)
        if what is None:
            self.send_error(404)
            return
        kind, value = what
        if kind == "redirect":
            self.send_response(302)
            self.send_header("Location", value)
            self.end_headers()
            return
        if kind == "slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if kind != "no-length":
            self.send_header("Content-Length", str(len(value)))
        self.end_headers()
        self.wfile.write(value)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    data = png(noise_image(5))
    _Handler.routes.update({
        "/cat.png": ("file", data), "/chunked.png": ("no-length", data),
        "/big.png": ("file", b"\0" * 5000), "/big-chunked.png": ("no-length", b"\0" * 200_000),
        "/r1": ("redirect", "/cat.png"), "/r2": ("redirect", "/r1"), "/r3": ("redirect", "/r2"),
        "/to-file": ("redirect", "file:///etc/passwd"), "/slow": ("slow", None),
        "/to-loopback-name": ("redirect", f"http://localhost:{srv.server_address[1]}/cat.png"),
        "/to-other-loopback": ("redirect", f"http://127.0.0.2:{srv.server_address[1]}/cat.png"),
    })
    yield base
    srv.shutdown()
    srv.server_close()


def test_fetch_url_with_limits(image_host: str) -> None:
    data = _Handler.routes["/cat.png"][1]
    lim = ImageLimits(allow_image_urls=True, image_url_max_redirects=2, max_image_bytes=100_000,
                      image_url_timeout_s=1.0, allow_private_image_urls=True)  # the host is on loopback
    assert fetch_url(image_host + "/cat.png", "f", lim) == data
    assert fetch_url(image_host + "/chunked.png", "f", lim) == data
    assert fetch_url(image_host + "/r2", "f", lim) == data  # two redirects: allowed
    assert image_bytes(image_host + "/cat.png", "f", lim) == data

    def code_of(path: str, limits: ImageLimits = lim) -> str | None:
        with pytest.raises(APIError) as e:
            fetch_url(image_host + path, "messages[0].content[0].image_url", limits)
        assert e.value.status == 400 and e.value.param == "messages[0].content[0].image_url"
        return e.value.code

    assert code_of("/r3") == "image_fetch_failed"  # three redirects: one too many
    assert code_of("/to-file") == "image_fetch_failed"
    assert code_of("/missing") == "image_fetch_failed"
    assert code_of("/big.png", ImageLimits(allow_image_urls=True, max_image_bytes=1000,
                                           allow_private_image_urls=True)) == "image_too_large"
    assert code_of("/big-chunked.png") == "image_too_large"
    t0 = time.monotonic()
    assert code_of("/slow", ImageLimits(allow_image_urls=True, image_url_timeout_s=0.5,
                                        allow_private_image_urls=True)) == "image_fetch_failed"
    assert time.monotonic() - t0 < 3.0


# --------------------------------------------------------------------------- request shapes
def test_chat_parts_render_the_image_token_where_each_image_was() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [text("A "), image("data:a"), text(" vs "),
                                     {"type": "image_url", "image_url": "data:b"}]},
        {"role": "user", "content": [image("data:c")]},
    ]})
    msgs = body.template_messages("<image>")
    assert [m["content"] for m in msgs] == ["be brief", "A <image> vs <image>", "<image>"]
    assert body.image_refs() == [("messages[1].content[1].image_url", "data:a"),
                                 ("messages[1].content[3].image_url", "data:b"),
                                 ("messages[2].content[0].image_url", "data:c")]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content\[1\]\.image_url: this model does not"):
        body.template_messages(None)
    bad = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.type"):
        bad.template_messages("<image>")


def test_generate_image_data_shapes() -> None:
    one = GenerateRequest.model_validate({"text": "<image>hi", "image_data": "AAAA"})
    assert one.image_refs(1) == [[("image_data", "AAAA")]]
    two = GenerateRequest.model_validate({"text": "<image><image>", "image_data": ["a", "b"]})
    assert two.image_refs(1) == [[("image_data[0]", "a"), ("image_data[1]", "b")]]
    batch = GenerateRequest.model_validate({"text": ["<image>", "x", "<image><image>"],
                                            "image_data": ["a", None, ["b", "c"]]})
    assert batch.image_refs(3) == [[("image_data[0]", "a")], [],
                                   [("image_data[2][0]", "b"), ("image_data[2][1]", "c")]]
    assert GenerateRequest.model_validate({"text": "x"}).image_refs(1) == [[]]
    with pytest.raises(ValueError, match="one entry per prompt"):
        GenerateRequest.model_validate({"text": ["a", "b"], "image_data": ["a"]}).image_refs(2)
    with pytest.raises(ValueError, match=r"image_data\[0\] must be a string"):
        GenerateRequest.model_validate({"text": "a", "image_data": [5]}).image_refs(1)


# --------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def vlm() -> Iterator[tuple[str, ServerHandle]]:
    base_url, handle = start_server(VLM, kv_cache_tokens=8192, max_running_requests=16)
    yield base_url, handle
    handle.stop()


@pytest.fixture(scope="module")
def text_server() -> Iterator[tuple[str, ServerHandle]]:
    base_url, handle = start_server("tiny-random", kv_cache_tokens=4096)
    yield base_url, handle
    handle.stop()


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_model_info_says_it_understands_images(vlm: tuple[str, ServerHandle],
                                               text_server: tuple[str, ServerHandle]) -> None:
    info = httpx.get(vlm[0] + "/get_model_info").json()
    assert info["has_image_understanding"] is True
    assert info["vision"]["image_token"] == "<image>"
    assert info["vision"]["tokens_per_image"] == TOKENS_PER_IMAGE
    assert httpx.get(text_server[0] + "/get_model_info").json()["has_image_understanding"] is False


def test_same_image_again_is_served_from_the_cache(vlm: tuple[str, ServerHandle]) -> None:
    url, handle = vlm
    client = _oai(url)
    uri = data_uri(png(noise_image(10)))

    def ask(question: str) -> Any:
        return client.chat.completions.create(
            model=VLM, max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": [image(uri), text(question)]}])

    first = ask("What is in the picture?")
    again = ask("What is in the picture?")
    other = ask("And what colour is it?")
    header = len(handle.engine.tokenizer.encode("<|im_start|>user\n"))
    for r in (first, again, other):
        assert r.choices[0].finish_reason in ("length", "stop")
    # prompt_tokens counts each image at its expanded size.
    assert first.usage.prompt_tokens > TOKENS_PER_IMAGE
    assert first.usage.prompt_tokens_details.cached_tokens < TOKENS_PER_IMAGE
    assert again.usage.prompt_tokens_details.cached_tokens >= header + TOKENS_PER_IMAGE
    assert other.usage.prompt_tokens_details.cached_tokens >= header + TOKENS_PER_IMAGE
    assert again.choices[0].message.content == first.choices[0].message.content
    handle.check_integrity()


def test_same_pixels_in_another_encoding_hit_and_one_changed_pixel_misses(
        vlm: tuple[str, ServerHandle]) -> None:
    url, _ = vlm
    img = noise_image(11)
    changed = img.copy()
    changed.putpixel((5, 5), tuple((v + 128) % 256 for v in img.getpixel((5, 5))))

    def cached(data: bytes, q: str) -> int:
        r = httpx.post(url + "/v1/chat/completions", json=chat_body(image(data_uri(data)), text(q)), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(png(img, compress_level=1), "first look") < TOKENS_PER_IMAGE
    assert cached(png(img, compress_level=9), "second look") >= TOKENS_PER_IMAGE
    assert cached(png(changed), "third look") < TOKENS_PER_IMAGE


def test_several_images_streamed_and_n_choices(vlm: tuple[str, ServerHandle]) -> None:
    url, _ = vlm
    a, b = data_uri(png(noise_image(12))), data_uri(png(noise_image(13)))
    stream = _oai(url).chat.completions.create(
        model=VLM, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [text("compare "), image(a), text(" and "), image(b)]}])
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens > 2 * TOKENS_PER_IMAGE
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(image(a), text("?"), n=2), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_generate_with_image_data(vlm: tuple[str, ServerHandle]) -> None:
    url, _ = vlm
    data = png(noise_image(14))
    body = {"text": "Look: <image> what is it?", "image_data": base64.b64encode(data).decode(),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r1 = httpx.post(url + "/generate", json=body, timeout=60)
    assert r1.status_code == 200, r1.text
    body["image_data"] = data_uri(png(noise_image(14), compress_level=0))
    r2 = httpx.post(url + "/generate", json=body, timeout=60)
    assert r2.status_code == 200, r2.text
    m1, m2 = r1.json()["meta_info"], r2.json()["meta_info"]
    assert m1["prompt_tokens"] == m2["prompt_tokens"] > TOKENS_PER_IMAGE
    assert m2["cached_tokens"] >= TOKENS_PER_IMAGE
    assert r1.json()["output_ids"] == r2.json()["output_ids"]
    batch = httpx.post(url + "/generate", json={
        "text": ["<image> one", "no image", "<image><image> two"],
        "image_data": [data_uri(data), None, [data_uri(data), data_uri(png(noise_image(15)))]],
        "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert batch.status_code == 200, batch.text
    assert [len(x["output_ids"]) for x in batch.json()] == [2, 2, 2]
    # The placeholder count must match the images.
    bad = httpx.post(url + "/generate", json={"text": "no placeholder", "image_data": data_uri(data)})
    assert_400(bad, "text", "image_placeholder_mismatch")


def test_bad_images_are_400s_naming_the_field_and_the_server_keeps_serving(
        vlm: tuple[str, ServerHandle]) -> None:
    url, handle = vlm
    chat = url + "/v1/chat/completions"
    field = "messages[0].content[1].image_url"
    assert_400(httpx.post(chat, json=chat_body(text("x"), image("data:image/png;base64,@@@"))), field,
               "invalid_image")
    not_image = data_uri(b"this is plain text, not a picture")
    assert_400(httpx.post(chat, json=chat_body(text("x"), image(not_image))), field, "invalid_image")
    assert_400(httpx.post(chat, json=chat_body(text("x"), image("https://example.com/a.png"))), field,
               "image_urls_disabled")
    uri = data_uri(png(noise_image(16)))
    nine = [image(uri) for _ in range(9)]
    assert_400(httpx.post(chat, json=chat_body(*nine)), "messages", "too_many_images")
    # "<image>" typed as text on top of one image part: the counts differ.
    assert_400(httpx.post(chat, json=chat_body(text("<image>"), image(uri))), "messages",
               "image_placeholder_mismatch")
    # The openai client sees the same error.
    with pytest.raises(openai.BadRequestError) as e:
        _oai(url).chat.completions.create(
            model=VLM, max_tokens=2, messages=[{"role": "user", "content": [text("x"), image(not_image)]}])
    assert e.value.body["param"] == field
    srv = handle.app.state.server
    saved = srv.image_limits
    srv.image_limits = ImageLimits(max_image_bytes=2000, max_image_pixels=10_000)
    try:
        assert_400(httpx.post(chat, json=chat_body(text("x"), image(uri))), field, "image_too_large")
        big = data_uri(png(Image.new("RGB", (200, 100), (1, 2, 3))))  # small file, 20000 pixels
        err = assert_400(httpx.post(chat, json=chat_body(text("x"), image(big))), field, "image_too_large")
        assert "pixels" in err["message"]
        assert_400(httpx.post(url + "/generate", json={"text": "<image>", "image_data": uri}),
                   "image_data", "image_too_large")
    finally:
        srv.image_limits = saved
    ok = httpx.post(chat, json=chat_body(image(uri), text("still there?")), timeout=60)
    assert ok.status_code == 200, ok.text
    handle.check_integrity()


def test_image_urls_when_allowed(vlm: tuple[str, ServerHandle], image_host: str) -> None:
    url, handle = vlm
    srv = handle.app.state.server
    saved = srv.image_limits
    srv.image_limits = ImageLimits(allow_image_urls=True, image_url_timeout_s=5.0, allow_private_image_urls=True)
    try:
        data = _Handler.routes["/cat.png"][1]
        r1 = httpx.post(url + "/v1/chat/completions", json=chat_body(image(image_host + "/cat.png"), text("a")),
                        timeout=60)
        assert r1.status_code == 200, r1.text
        # The same pixels as a data URI: the same content key.
        r2 = httpx.post(url + "/v1/chat/completions", json=chat_body(image(data_uri(data)), text("b")),
                        timeout=60)
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= TOKENS_PER_IMAGE
        assert_400(httpx.post(url + "/v1/chat/completions", json=chat_body(image(image_host + "/missing"))),
                   "messages[0].content[0].image_url", "image_fetch_failed")
    finally:
        srv.image_limits = saved


def test_metrics_count_image_requests_and_cached_image_tokens(vlm: tuple[str, ServerHandle]) -> None:
    url, _ = vlm
    uri = data_uri(png(noise_image(17)))
    for q in ("one", "two"):
        assert httpx.post(url + "/v1/chat/completions", json=chat_body(image(uri), text(q)), timeout=60).status_code == 200
    m = httpx.get(url + "/metrics").text

    def value(name: str) -> float:
        line = next(ln for ln in m.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("radixserve_image_requests_total") >= 2
    assert value("radixserve_images_total") >= 2
    assert value("radixserve_prefix_cache_image_hit_tokens_total") >= TOKENS_PER_IMAGE
    assert value("radixserve_prefix_cache_image_query_tokens_total") >= 2 * TOKENS_PER_IMAGE


def test_text_model_refuses_images(text_server: tuple[str, ServerHandle]) -> None:
    url, _ = text_server
    uri = data_uri(png(noise_image(18)))
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [text("hi"), image(uri)]}], "max_tokens": 2})
    err = assert_400(r, "messages[0].content[1].image_url", "images_not_supported")
    assert "does not accept images" in err["message"]
    assert_400(httpx.post(url + "/generate", json={"text": "hi", "image_data": uri}), "image_data",
               "images_not_supported")
    # Text content parts still work there, and the server keeps serving.
    ok = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [text("hi")]}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_images_reach_an_engine_core_in_its_own_process() -> None:
    """The served path: pixels cross ZMQ to the engine-core process (``ImagePayload``); the
    same image again hits there, and the answer equals the in-process engine's."""
    from radixserve import Engine, SamplingParams
    from radixserve.config import EngineConfig

    cfg = EngineConfig(model=VLM, dtype="float32", kv_cache_tokens=4096)
    img = noise_image(77)
    prompt_msgs = [{"role": "user", "content": [image(data_uri(png(img))), text("What is it?")]}]
    base_url, handle = start_server(engine=cfg)
    try:
        assert handle.app.state.cores and handle.app.state.cores[0].pid  # a separate process
        client = _oai(base_url)
        first = client.chat.completions.create(model=VLM, max_tokens=6, temperature=0, messages=prompt_msgs)
        again = client.chat.completions.create(model=VLM, max_tokens=6, temperature=0, messages=prompt_msgs)
        assert first.usage.prompt_tokens_details.cached_tokens < TOKENS_PER_IMAGE
        assert again.usage.prompt_tokens_details.cached_tokens >= TOKENS_PER_IMAGE
        assert again.choices[0].message.content == first.choices[0].message.content
        handle.check_integrity()
    finally:
        handle.stop()
    eng = Engine(VLM, dtype="float32", kv_cache_tokens=4096)
    text_prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "<image>What is it?"}],
                                                    add_generation_prompt=True)
    local = eng.generate(text_prompt, SamplingParams(max_tokens=6, temperature=0), images=[img])[0]
    assert local.text == first.choices[0].message.content


def test_dp_routes_an_images_questions_to_the_core_that_holds_it() -> None:
    """``serve --dp 2``: the mirror of each core's tree holds the image keys, so every later
    question about an image goes to the core that computed it and hits there."""
    from radixserve.config import EngineConfig, ServerConfig

    cfg = EngineConfig(model=VLM, dtype="float32", kv_cache_tokens=4096, num_threads=1)
    imgs = [noise_image(90 + i) for i in range(4)]
    base_url, handle = start_server(engine=cfg, server=ServerConfig(dp=2, log_level="warning"))
    try:
        client = _oai(base_url)
        cached = []
        for q in ("What is it?", "Which colour?", "How many?"):
            for im in imgs:
                r = client.chat.completions.create(
                    model=VLM, max_tokens=3, temperature=0,
                    messages=[{"role": "user", "content": [image(data_uri(png(im))), text(q)]}])
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
        # The first question of each image computes it; the two later ones hit its tokens
        # (one miss allowed: a core's cache events may arrive after its response).
        later = cached[len(imgs):]
        assert sum(c >= TOKENS_PER_IMAGE for c in later) >= len(later) - 1, cached
        assert all(c < TOKENS_PER_IMAGE for c in cached[:len(imgs)]), cached
        served = [c for c in handle.client.clients if c.load is not None]
        assert len(served) == 2  # new images were dealt out to both cores
        handle.check_integrity()
    finally:
        handle.stop()


# --------------------------------------------------------------------------- URLs: which addresses
@pytest.mark.parametrize("addr,why", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("10.1.2.3", "private"), ("172.16.0.1", "private"),
    ("192.168.1.1", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("fc00::1", "private"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"),
    ("240.0.0.1", "reserved"), ("100.64.0.1", "not global"), ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"), ("2002:7f00:1::", "loopback"), ("8.8.8.8", None), ("1.1.1.1", None),
    ("2001:4860:4860::8888", None),
])
def test_which_addresses_an_image_url_may_reach(addr: str, why: str | None) -> None:
    assert AddressPolicy(allow_private=False).refusal(ipaddress.ip_address(addr)) == why
    assert AddressPolicy(allow_private=True).refusal(ipaddress.ip_address(addr)) is None


class _LoopbackIsPublic(AddressPolicy):
    """As if 127.0.0.1 were a public address (the test's image host is the only one there is);
    every other address keeps its real verdict. ``answers`` replaces DNS for host names."""

    def __init__(self, answers: dict[str, list[list[str]]] | None = None):
        super().__init__(allow_private=False)
        self.answers = answers or {}
        self.lookups: list[str] = []

    def refusal(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        return None if str(ip) == "127.0.0.1" else super().refusal(ip)

    def resolve(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        if host in self.answers:
            return self.answers[host].pop(0)  # a different answer each time: DNS rebinding
        return super().resolve(host, port)


def test_image_urls_to_private_addresses_are_refused_unless_allowed(image_host: str) -> None:
    data = _Handler.routes["/cat.png"][1]
    port = image_host.rsplit(":", 1)[1]
    lim = ImageLimits(allow_image_urls=True, image_url_timeout_s=5.0)
    field = "messages[0].content[0].image_url"

    def refused(url: str, limits: ImageLimits = lim, policy: AddressPolicy | None = None) -> str:
        before = len(_Handler.served)
        with pytest.raises(APIError) as e:
            fetch_url(url, field, limits, policy)
        assert e.value.status == 400 and e.value.param == field and e.value.code == "image_url_forbidden"
        assert len(_Handler.served) == before  # refused before connecting
        return e.value.message

    assert "127.0.0.1" in refused(image_host + "/cat.png") and "loopback" in refused(image_host + "/cat.png")
    assert "loopback" in refused(f"http://localhost:{port}/cat.png")  # every address a name resolves to
    assert "--allow-private-image-urls" in refused(image_host + "/cat.png")
    assert fetch_url(image_host + "/cat.png", field, ImageLimits(allow_image_urls=True,
                                                                 allow_private_image_urls=True)) == data
    # A redirect is checked like the first URL: an allowed host cannot send the fetch inward.
    policy = _LoopbackIsPublic()
    assert fetch_url(image_host + "/cat.png", field, lim, policy) == data
    before = len(_Handler.served)
    with pytest.raises(APIError) as e:
        fetch_url(image_host + "/to-other-loopback", field, lim, policy)
    assert e.value.code == "image_url_forbidden" and "127.0.0.2" in e.value.message
    assert _Handler.served[before:] == ["/to-other-loopback"]
    before = len(_Handler.served)
    with pytest.raises(APIError) as e:
        fetch_url(image_host + "/to-loopback-name", field, lim, _LoopbackIsPublic({"localhost": [["::1"]]}))
    assert e.value.code == "image_url_forbidden" and "'localhost' is at ::1" in e.value.message
    assert _Handler.served[before:] == ["/to-loopback-name"]


def test_an_image_url_is_fetched_from_the_address_that_was_checked(image_host: str) -> None:
    """DNS rebinding: a name that resolves to an allowed address when checked and to a private
    one a moment later. The name is resolved once and the connection goes to the address
    that was checked."""
    data = _Handler.routes["/cat.png"][1]
    port = image_host.rsplit(":", 1)[1]
    policy = _LoopbackIsPublic({"images.example": [["127.0.0.1"], ["10.0.0.1"], ["10.0.0.1"]]})
    lim = ImageLimits(allow_image_urls=True, image_url_timeout_s=5.0)
    before = len(_Handler.served)
    assert fetch_url(f"http://images.example:{port}/cat.png", "image_data", lim, policy) == data
    assert policy.lookups == ["images.example"]
    assert _Handler.served[before:] == ["/cat.png"]


def test_a_vlm_server_refuses_image_urls_to_its_own_network(vlm: tuple[str, ServerHandle], image_host: str) -> None:
    url, handle = vlm
    srv = handle.app.state.server
    saved = srv.image_limits
    cfg = ServerConfig(allow_image_urls=True, image_url_timeout_s=5.0)  # what --allow-image-urls gives
    srv.image_limits = ImageLimits.from_config(cfg)
    try:
        before = len(_Handler.served)
        err = assert_400(httpx.post(url + "/v1/chat/completions", json=chat_body(image(image_host + "/cat.png"),
                                                                                 text("a")), timeout=60),
                         "messages[0].content[0].image_url", "image_url_forbidden")
        assert "loopback" in err["message"] and len(_Handler.served) == before
        assert_400(httpx.post(url + "/generate", json={"text": "<image>", "image_data": image_host + "/cat.png"},
                              timeout=60), "image_data", "image_url_forbidden")
        srv.image_limits = ImageLimits.from_config(ServerConfig(allow_image_urls=True, allow_private_image_urls=True))
        ok = httpx.post(url + "/v1/chat/completions", json=chat_body(image(image_host + "/cat.png"), text("a")),
                        timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        srv.image_limits = saved
