"""A minimal vLLM-style prefill/decode proxy, written once per candidate HTTP stack, so that the
stacks can be compared doing the same job (bench/bench_http_stack.py).

The job, identical in every stack: take ``POST /v1/chat/completions``, parse the JSON body, send
the prefill leg (the request with ``"stream": false``, ``"max_tokens": 1`` and
``kv_transfer_params`` asking for a remote decode) to the prefill engine, read its JSON answer,
splice its ``kv_transfer_params`` into the client's original bytes (no second encode of the
request), send that to the decode engine over a pooled keep-alive connection and relay the
answer: whole, or chunk by chunk when the request asked for ``"stream": true``.

Stacks:

- ``aiohttp``: aiohttp.web + one shared aiohttp.ClientSession (TCPConnector limit=0), stdlib
  json, the default asyncio loop (Motor's inference port before the change).
- ``aiohttp-uvloop``: the same on uvloop.
- ``protocols``: motor_mesh.common.httpserver.HttpServer + motor_mesh.common.httpclient.Pool, stdlib
  json, the default asyncio loop.
- ``protocols-uvloop``: the same on uvloop.
- ``protocols-uvloop-orjson``: the same with orjson (what Motor runs).

    python -m bench.loadgen.stack_proxy --stack NAME --port 0 --prefill URL --decode URL

Prints ``LISTENING port=N`` on stderr once it serves; runs until killed. Loopback by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from motor_mesh.coordinator.bodies import KV, PREFILL_KV  # the prefill leg Motor sends

STACKS = ("aiohttp", "aiohttp-uvloop", "protocols", "protocols-uvloop", "protocols-uvloop-orjson")
PATH = "/v1/chat/completions"
MAX_BODY = 4 << 20
JSON_CT = "application/json"


@dataclass(frozen=True)
class Codec:
    loads: Callable[[bytes], Any]
    dumps: Callable[[Any], bytes]


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


STDLIB = Codec(json.loads, _std_dumps)


def orjson_codec() -> Codec:
    import orjson

    return Codec(orjson.loads, orjson.dumps)


def prefill_body(req: dict[str, Any], codec: Codec) -> bytes:
    leg = dict(req)
    leg["stream"] = False
    leg["max_tokens"] = 1
    leg.pop("stream_options", None)
    leg[KV] = PREFILL_KV
    return codec.dumps(leg)


def decode_body(raw: bytes, prefill_answer: bytes, codec: Codec) -> bytes:
    """The client's bytes with the prefill's kv_transfer_params spliced before the last brace
    (the bytes unchanged when the prefill gave none)."""
    answer = codec.loads(prefill_answer)
    kv = answer.get(KV) if isinstance(answer, dict) else None
    if not isinstance(kv, dict):
        return raw
    return raw.rstrip()[:-1] + b',"kv_transfer_params":' + codec.dumps(kv) + b"}"


def parse_request(raw: bytes, codec: Codec) -> dict[str, Any] | None:
    try:
        req = codec.loads(raw)
    except ValueError:
        return None
    return req if isinstance(req, dict) else None


BAD_BODY = b'{"error":{"message":"request body must be a JSON object","type":"invalid_request_error"}}'


# -- aiohttp ----------------------------------------------------------------------------------


async def serve_aiohttp(host: str, port: int, prefill: str, decode: str, codec: Codec) -> None:
    import aiohttp
    from aiohttp import web

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    prefill_url, decode_url = prefill.rstrip("/") + PATH, decode.rstrip("/") + PATH
    headers = {"Content-Type": JSON_CT}

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        req = parse_request(raw, codec)
        if req is None:
            return web.Response(status=400, body=BAD_BODY, content_type=JSON_CT)
        async with session.post(prefill_url, data=prefill_body(req, codec), headers=headers) as r:
            answer = await r.read()
            if r.status >= 400:
                return web.Response(status=r.status, body=answer, content_type=JSON_CT)
        body = decode_body(raw, answer, codec)
        async with session.post(decode_url, data=body, headers=headers) as r:
            ctype = r.headers.get("Content-Type", JSON_CT)
            if req.get("stream") is not True or r.status >= 400:
                return web.Response(status=r.status, body=await r.read(), headers={"Content-Type": ctype})
            out = web.StreamResponse(status=r.status, headers={"Content-Type": ctype})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post(PATH, chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1])
    _announce(bound)
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


# -- asyncio protocols + httptools (services/common/httpserver.py, httpclient.py) ---------------


async def serve_protocols(host: str, port: int, prefill: str, decode: str, codec: Codec) -> None:
    from motor_mesh.common.httpclient import Pool
    from motor_mesh.common.httpmessages import Request, Responder, route_table
    from motor_mesh.common.httpserver import HttpServer

    pool = Pool(connect_timeout_s=5.0)
    p, d = urlsplit(prefill), urlsplit(decode)
    ph, pp, dh, dp = p.hostname or "127.0.0.1", p.port or 80, d.hostname or "127.0.0.1", d.port or 80
    path = PATH.encode()
    json_ct = JSON_CT.encode()

    async def chat(request: Request, out: Responder) -> None:
        raw = request.body
        req = parse_request(raw, codec)
        if req is None:
            out.send(400, BAD_BODY)
            return
        r = await pool.request(ph, pp, b"POST", path, prefill_body(req, codec))
        try:
            answer = await r.read()
        finally:
            r.release()
        if r.status >= 400:
            out.send(r.status, answer)
            return
        r = await pool.request(dh, dp, b"POST", path, decode_body(raw, answer, codec))
        try:
            ctype = r.header(b"content-type", json_ct)
            if req.get("stream") is not True or r.status >= 400:
                out.send(r.status, await r.read(), ctype)
                return
            out.start(r.status, ctype)
            while (chunk := await r.next_chunk()) is not None:
                await out.write(chunk)
            out.end()
        finally:
            r.release()

    server = HttpServer(route_table({("POST", PATH): chat}), max_body_bytes=MAX_BODY)
    bound = await server.listen(host, port)
    _announce(bound)
    try:
        await asyncio.Event().wait()
    finally:
        pool.close()
        await server.close(0.0)


def _announce(port: int) -> None:
    print(f"LISTENING port={port}", file=sys.stderr, flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen.stack_proxy")
    p.add_argument("--stack", required=True, choices=STACKS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prefill", required=True, help="prefill engine base URL, http://127.0.0.1:PORT")
    p.add_argument("--decode", required=True, help="decode engine base URL")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    stack: str = args.stack
    codec = orjson_codec() if stack.endswith("-orjson") else STDLIB
    serve = serve_aiohttp if stack.startswith("aiohttp") else serve_protocols
    coro: Coroutine[Any, Any, None] = serve(args.host, args.port, args.prefill, args.decode, codec)
    try:
        if "-uvloop" in stack:
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(coro)
        else:
            asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
