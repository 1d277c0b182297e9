"""The router's own HTTP/1.1 server, driven over raw sockets (and httpx) with a small ASGI app."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from radixserve.router.http_server import HTTPServer

events: list = []


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            events.append(msg["type"])
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    path = scope["path"]
    body = (await receive())["body"]
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if path == "/wait-disconnect":
        msg = await receive()  # returns when the client goes away
        events.append(msg["type"])
        return
    if path == "/big":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(64):
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    out = json.dumps({"method": scope["method"], "path": path, "query": scope["query_string"].decode(),
                      "body": body.decode(), "headers": {k.decode(): v.decode() for k, v in scope["headers"]}})
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out.encode()})


@pytest.fixture(scope="module")
def server():
    srv = HTTPServer(app)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=lambda: loop.run_until_complete(srv.serve("127.0.0.1", 0)), daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield srv
    srv.should_exit = True
    t.join(10)
    assert events[0] == "lifespan.startup" and events[-1] == "lifespan.shutdown"


def raw(server, data: bytes, read_until_close: bool = True, timeout: float = 5.0) -> bytes:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(timeout)
    s.sendall(data)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            if not read_until_close:
                break
    except socket.timeout:
        pass
    s.close()
    return out


def test_json_round_trip_and_keep_alive(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as c:
        for i in range(3):
            r = c.post(f"/echo?i={i}", json={"n": i})
            assert r.status_code == 201
            assert json.loads(r.json()["body"]) == {"n": i} and r.json()["query"] == f"i={i}"


def test_pipelined_requests_answered_in_order(server):
    reqs = b"".join(b"POST /p%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (i, i) for i in range(3))
    reqs += b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    out = raw(server, reqs)
    assert out.count(b"HTTP/1.1 201") == 4
    paths = [json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])["path"]
             for part in out.split(b"HTTP/1.1 201 Created\r\n")[1:]]
    assert paths == ["/p0", "/p1", "/p2", "/last"]
    assert b"connection: close" in out


def test_chunked_request_body_and_100_continue(server):
    out = raw(server, b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n"
                      b"Connection: close\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
    assert json.loads(out.split(b"\r\n\r\n")[-1])["body"] == "abcde"


def test_http10_closes_by_default(server):
    out = raw(server, b"GET /old HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 201") and b"connection: close" in out


def test_streamed_response_is_chunked(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as c:
        with c.stream("GET", "/stream") as r:
            assert r.headers["transfer-encoding"] == "chunked"
            assert "".join(r.iter_text()) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
        big = c.get("/big")
        assert len(big.content) == 64 * 65536


def test_malformed_requests_get_an_error_and_a_close(server):
    assert raw(server, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert raw(server, b"GET / HTTP/1.1\r\nbad header\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert raw(server, b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert raw(server, b"GET / HTTP/1.1\r\nX: " + b"a" * 70000).startswith(b"HTTP/1.1 431")


def test_app_hears_the_client_leave(server):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"GET /wait-disconnect HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    s.close()
    deadline = time.monotonic() + 5
    while "http.disconnect" not in events:
        assert time.monotonic() < deadline
        time.sleep(0.02)
