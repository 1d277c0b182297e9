"""The router's HTTP/1.1 client against a real (scripted) asyncio server."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.router.upstream import UpstreamClient, UpstreamError


async def serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for ln in head.split(b"\r\n"):
        if ln.lower().startswith(b"content-length:"):
            n = int(ln.split(b":")[1])
    return head + (await reader.readexactly(n) if n else b"")


def run(coro):
    return asyncio.run(coro)


def test_content_length_chunked_and_keep_alive():
    conns = []

    async def handler(reader, writer):
        conns.append(writer)
        while True:
            try:
                req = await read_request(reader)
            except asyncio.IncompleteReadError:
                break
            if b"/chunked" in req:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n")
            else:
                body = req.split(b"\r\n\r\n", 1)[1]
                writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def main():
        server, url = await serve(handler)
        c = UpstreamClient(read_timeout=5)
        assert await c.fetch("POST", url, "/echo", b'{"a": 1}') == (201, "application/json", b'{"a": 1}')
        resp = await c.request("GET", url, "/chunked")
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        assert [x async for x in resp.chunks()] == [b"hello", b" world"]
        assert (await c.fetch("POST", url, "/echo", b"x"))[2] == b"x"
        assert len(conns) == 1  # one connection for all three
        await c.aclose()
        server.close()

    run(main())


def test_stale_pooled_connection_is_retried_fresh():
    served = []

    async def handler(reader, writer):
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # like an idle keep-alive timeout: the pooled connection is dead

    async def main():
        server, url = await serve(handler)
        c = UpstreamClient(read_timeout=5)
        assert (await c.fetch("GET", url, "/a"))[2] == b"ok"
        await asyncio.sleep(0.05)
        assert (await c.fetch("GET", url, "/b"))[2] == b"ok"
        assert len(served) == 2
        await c.aclose()
        server.close()

    run(main())


def test_failures_raise_upstream_error():
    async def cut(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def silent(reader, writer):
        await read_request(reader)
        await asyncio.sleep(10)

    async def main():
        c = UpstreamClient(read_timeout=0.3)
        server, url = await serve(cut)
        with pytest.raises(UpstreamError, match="before the body was complete"):
            await c.fetch("GET", url, "/")
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await c.fetch("GET", url, "/")
        server, url = await serve(silent)
        with pytest.raises(UpstreamError, match="no answer within"):
            await c.fetch("GET", url, "/")
        with pytest.raises(ValueError, match="url"):
            await c.fetch("GET", "https://example.com", "/")
        await c.aclose()
        server.close()

    run(main())
