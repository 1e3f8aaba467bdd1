"""Traces of the inference path, in process: the spans an in-process Coordinator records (into an
in-memory exporter standing in for OTLP), the ``traceparent`` the engines receive (each
simulated engine counts them in ``motor_sim_traceparent_requests_total``) and the
``traceresponse`` header the client gets. The whole path through ``motor up`` into the engines'
own spans is tests/e2e/test_tracing.py."""

from __future__ import annotations

import re
import secrets
from typing import Any

import aiohttp
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from motor_mesh.common.enums import DECODE, PREFILL
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import MODEL, Engine, Running, StartCoordinator, get_text, instance, set_table
from tests.poll import until
from tests.ports import reserved_port

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Trace me."}], "max_tokens": 3}
TRACEPARENTS = re.compile(r"^motor_sim_traceparent_requests_total ([0-9.]+)$", re.M)


def _traceparent(trace_id: str, span_id: str, flags: str = "01") -> str:
    return f"00-{trace_id}-{span_id}-{flags}"


def _hex(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def _names(span: ReadableSpan) -> str:
    """The traceparent that names ``span``."""
    ctx = span.get_span_context()
    assert ctx is not None
    return _traceparent(*_hex(span), f"{ctx.trace_flags:02x}")


def _parent(span: ReadableSpan) -> str:
    return f"{span.parent.span_id:016x}" if span.parent else ""


async def _traceparents(http: aiohttp.ClientSession, *engines: Engine) -> list[float]:
    out = []
    for e in engines:
        m = TRACEPARENTS.search(await get_text(http, f"{e.base}/metrics"))
        assert m is not None
        out.append(float(m.group(1)))
    return out


async def _post(
    http: aiohttp.ClientSession, coord: Running, headers: dict[str, str], **body: Any
) -> tuple[int, dict[str, str], bytes]:
    async with http.post(f"http://{coord.http}{CHAT}", json={**BODY, **body}, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def _finished(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    got = list(exporter.get_finished_spans())
    assert len(got) == count, [s.name for s in got]
    return got


def _named(got: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in got if s.name == name), key=lambda s: s.start_time or 0)


async def test_off_no_trace_context_reaches_engines_or_clients(
    coord: Running, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    p, d = engines["vllm_p"], engines["vllm_d"]
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    before = await _traceparents(http, p, d)
    client_tp = _traceparent(secrets.token_hex(16), secrets.token_hex(8))
    for stream in (False, True):
        status, headers, _ = await _post(http, coord, {"traceparent": client_tp}, stream=stream)
        assert status == 200
        assert "traceresponse" not in {k.lower() for k in headers}
    # Not even the client's own traceparent is passed on: the Coordinator sends its own or none.
    assert await _traceparents(http, p, d) == before


async def test_a_request_is_a_server_span_with_a_leg_per_engine(
    spans: InMemorySpanExporter,
    start_coordinator: StartCoordinator,
    engines: dict[str, Engine],
    http: aiohttp.ClientSession,
) -> None:
    coord = await start_coordinator()
    p, d = engines["vllm_p"], engines["vllm_d"]
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    before = await _traceparents(http, p, d)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": _traceparent(trace_id, client_span), "tracestate": "vendor=opaque"}
    status, answer_headers, body = await _post(http, coord, headers, stream=True)
    assert status == 200 and b"[DONE]" in body

    got = await until(lambda: _finished(spans, 3), 5, "the request's spans", retry=(AssertionError,))
    (server,) = _named(got, f"POST {CHAT}")
    assert server.kind is SpanKind.SERVER and _parent(server) == client_span
    assert _hex(server)[0] == trace_id
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert answer_headers["traceresponse"] == _names(server)
    for name, engine, iid in (("prefill", p, 1), ("decode", d, 2)):
        (leg,) = _named(got, name)
        assert leg.kind is SpanKind.CLIENT and _parent(leg) == _hex(server)[1]
        assert leg.attributes is not None
        assert leg.attributes["motor.instance_id"] == iid
        assert leg.attributes["server.port"] == engine.port
        assert leg.attributes["url.full"] == f"{engine.base}{CHAT}"
        assert leg.attributes["http.response.status_code"] == 200
        assert leg.get_span_context().trace_state.get("vendor") == "opaque"  # type: ignore[union-attr]
    # The streamed decode leg lasts until the last byte reached the client.
    (decode,) = _named(got, "decode")
    assert decode.end_time is not None and server.end_time is not None
    assert decode.end_time <= server.end_time
    assert await _traceparents(http, p, d) == [n + 1 for n in before]


async def test_a_refused_prefill_is_one_failed_attempt_then_another(
    spans: InMemorySpanExporter,
    start_coordinator: StartCoordinator,
    engines: dict[str, Engine],
    http: aiohttp.ClientSession,
) -> None:
    coord = await start_coordinator(prefill_policy="round_robin")
    p, d = engines["vllm_p2"], engines["vllm_d"]
    dead = reserved_port()
    await set_table(
        coord, instance(1, PREFILL, dead), instance(2, PREFILL, p.port), instance(3, DECODE, d.port)
    )
    status, _, _ = await _post(http, coord, {})
    assert status == 200

    got = await until(lambda: _finished(spans, 4), 5, "the request's spans", retry=(AssertionError,))
    (server,) = _named(got, f"POST {CHAT}")
    assert server.parent is None  # no traceparent from the client: a trace of its own
    first, second = _named(got, "prefill")
    assert [_parent(s) for s in (first, second)] == [_hex(server)[1]] * 2
    assert first.attributes is not None and second.attributes is not None
    assert (first.attributes["motor.attempt"], first.attributes["motor.instance_id"]) == (1, 1)
    assert (first.attributes["server.port"], first.attributes["error.type"]) == (dead, "connect")
    assert first.status.status_code is StatusCode.ERROR
    assert (second.attributes["motor.attempt"], second.attributes["motor.instance_id"]) == (2, 2)
    assert second.attributes["http.response.status_code"] == 200
    assert server.status.status_code is StatusCode.UNSET


async def test_sglang_legs_run_side_by_side_under_the_request(
    spans: InMemorySpanExporter,
    start_coordinator: StartCoordinator,
    engines: dict[str, Engine],
    http: aiohttp.ClientSession,
) -> None:
    coord = await start_coordinator()
    p, d = engines["sgl_p"], engines["sgl_d"]
    sg = c.ENGINE_TYPE_SGLANG
    await set_table(
        coord,
        instance(1, PREFILL, p.port, engine_type=sg, bootstrap=p.bootstrap_port),
        instance(2, DECODE, d.port, engine_type=sg),
    )
    before = await _traceparents(http, p, d)
    status, _, _ = await _post(http, coord, {})
    assert status == 200

    got = await until(lambda: _finished(spans, 3), 5, "the request's spans", retry=(AssertionError,))
    (server,) = _named(got, f"POST {CHAT}")
    (prefill,), (decode,) = _named(got, "prefill"), _named(got, "decode")
    assert _parent(prefill) == _parent(decode) == _hex(server)[1]
    assert prefill.end_time is not None and decode.start_time is not None
    assert decode.start_time < prefill.end_time  # both legs at once, not one after the other
    assert await _traceparents(http, p, d) == [n + 1 for n in before]


async def test_an_unsampled_parent_records_nothing_but_passes_the_decision_on(
    spans: InMemorySpanExporter,
    start_coordinator: StartCoordinator,
    engines: dict[str, Engine],
    http: aiohttp.ClientSession,
) -> None:
    coord = await start_coordinator()
    p, d = engines["vllm_p"], engines["vllm_d"]
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    before = await _traceparents(http, p, d)
    trace_id = secrets.token_hex(16)
    status, headers, _ = await _post(
        http, coord, {"traceparent": _traceparent(trace_id, secrets.token_hex(8), "00")}
    )
    assert status == 200
    # The engines hear the same "not sampled" decision; the client learns its trace id.
    assert await _traceparents(http, p, d) == [n + 1 for n in before]
    assert re.fullmatch(rf"00-{trace_id}-[0-9a-f]{{16}}-00", headers["traceresponse"])
    # Then a sampled request: only its spans are there, nothing of the first one.
    await _post(http, coord, {"traceparent": _traceparent(secrets.token_hex(16), secrets.token_hex(8))})
    got = await until(lambda: _finished(spans, 3), 5, "the sampled request's spans", retry=(AssertionError,))
    assert all(_hex(s)[0] != trace_id for s in got)


async def test_errors_the_coordinator_answers_carry_the_trace(
    spans: InMemorySpanExporter, start_coordinator: StartCoordinator, http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    await set_table(coord, instance(1, PREFILL, reserved_port()), instance(2, DECODE, reserved_port()))
    status, headers, _ = await _post(http, coord, {}, model="no-such-model")
    assert status == 404
    status, headers_502, _ = await _post(http, coord, {})
    assert status == 502

    got = await until(lambda: _finished(spans, 3), 5, "both requests' spans", retry=(AssertionError,))
    missing, unreachable = _named(got, f"POST {CHAT}")
    assert headers["traceresponse"] == _names(missing)
    assert headers_502["traceresponse"] == _names(unreachable)
    assert missing.attributes is not None and unreachable.attributes is not None
    # A 404 is the client's mistake (the span is not an error); a 502 is the server's.
    assert missing.attributes["http.response.status_code"] == 404
    assert missing.status.status_code is StatusCode.UNSET
    assert unreachable.attributes["http.response.status_code"] == 502
    assert unreachable.status.status_code is StatusCode.ERROR
    (leg,) = _named(got, "prefill")  # the only prefill, refused; no decode leg was tried
    assert leg.attributes is not None and leg.attributes["error.type"] == "connect"
