"""The simulated engine traces like vLLM: with ``--otlp-traces-endpoint`` (vLLM's flag, no
OpenTelemetry variable set) it exports one ``llm_request`` span per completion request, child of
the request's ``traceparent``."""

from __future__ import annotations

import json
import secrets
import urllib.request
from collections.abc import Iterator

import pytest

from tests.e2e.test_tracing import FAST_EXPORT, SERVER, Collector, Span, traceparent
from tests.poll import wait_until
from tests.procs import SimEngine


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


def _complete(engine: SimEngine, headers: dict[str, str]) -> None:
    body = {"model": "motor-sim", "prompt": "Trace the engine.", "max_tokens": 5}
    req = urllib.request.Request(
        f"{engine.v1}/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_one_llm_request_span_per_request_under_its_traceparent(collector: Collector) -> None:
    engine = SimEngine("--port", "0", "--otlp-traces-endpoint", collector.endpoint, env=FAST_EXPORT).start()
    try:
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        _complete(engine, {"traceparent": traceparent(trace_id, parent)})
        _complete(engine, {})

        def both() -> list[Span]:
            got = collector.named("llm_request")
            assert len(got) == 2
            return got

        spans = wait_until(both, 10, "the engine's spans", retry=(AssertionError,))
        (child,) = [s for s in spans if s.trace_id == trace_id]
        assert (child.parent_id, child.kind, child.service) == (parent, SERVER, "motor-sim")
        attrs = child.attributes
        assert attrs["gen_ai.request.id"].startswith("cmpl-")
        assert attrs["gen_ai.usage.completion_tokens"] == attrs["gen_ai.request.max_tokens"] == 5
        assert attrs["gen_ai.usage.prompt_tokens"] > 0
        assert attrs["gen_ai.response.finish_reasons"] == '["length"]'
        assert attrs["http.response.status_code"] == 200
        (root,) = [s for s in spans if s.trace_id != trace_id]
        assert root.parent_id == ""  # no traceparent: a trace of its own
    finally:
        engine.kill()
