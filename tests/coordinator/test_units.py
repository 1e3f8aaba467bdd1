"""Pure pieces of the router: body rewriting, SSE filtering, policies, the routing view, the breaker."""

from __future__ import annotations

import json
from collections import Counter

from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.coordinator import bodies
from motor_mesh.coordinator.health import Breaker
from motor_mesh.coordinator.policies import RoundRobin, least_load, power_of_two
from motor_mesh.coordinator.routes import DownCount, RoutingView, Target, build_view
from motor_mesh.coordinator.table import RoutingTable
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import MODEL, instance
from tests.simengine.test_sim_pd import PREFILL_KV


def test_with_fields_splices_or_merges() -> None:
    raw = b' {"model": "m", "messages": [{"role": "user", "content": "}"}]}\n'
    req = json.loads(raw)
    out = bodies.with_fields(raw, req, {"bootstrap_room": 7, "bootstrap_host": "h"})
    assert json.loads(out) == {**req, "bootstrap_room": 7, "bootstrap_host": "h"}
    assert out.startswith(b'{"model": "m"')  # the client's bytes, not a re-serialisation
    # A field the client already sent is replaced, never duplicated.
    req2 = {"model": "m", "kv_transfer_params": {"x": 1}}
    out2 = bodies.with_fields(json.dumps(req2).encode(), req2, {"kv_transfer_params": {"y": 2}})
    assert json.loads(out2) == {"model": "m", "kv_transfer_params": {"y": 2}}
    assert json.loads(bodies.with_fields(b"{}", {}, {"a": 1})) == {"a": 1}


def test_prefill_body() -> None:
    req = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True},
           "max_tokens": 50, "max_completion_tokens": 50}  # fmt: skip
    leg = json.loads(bodies.prefill_body(req))
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg
    assert leg["kv_transfer_params"] == PREFILL_KV
    assert "max_completion_tokens" not in json.loads(bodies.prefill_body({"model": "m"}))
    assert req["stream"] is True  # the client's request is untouched


def test_strip_kv_from_answers() -> None:
    plain = b'{"id":"x","choices":[]}'
    assert bodies.strip_kv(plain) is plain
    with_kv = json.dumps({"id": "x", "kv_transfer_params": {"a": 1}, "choices": [{"kv_transfer_params": 1}]})
    assert json.loads(bodies.strip_kv(with_kv.encode())) == {"id": "x", "choices": [{}]}


def test_sse_filter_strips_even_when_split_across_reads() -> None:
    events = [
        b'data: {"id":"1","choices":[{"text":"a"}]}\n\n',
        b'data: {"id":"2","choices":[{"text":"b"}],"kv_transfer_params":{"remote_host":"h"}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for size in (1, 3, 7, 64, len(stream)):
        f = bodies.SseFilter()
        out = b"".join(f.feed(stream[i : i + size]) for i in range(0, len(stream), size)) + f.flush()
        assert b"kv_transfer_params" not in out
        assert out.count(b"\n\n") == 3 and b'"text":"b"' in out and out.endswith(b"data: [DONE]\n\n")
    # Complete events are released at once.
    f = bodies.SseFilter()
    assert f.feed(events[0] + b"data: {") == events[0]


def test_estimate_tokens() -> None:
    assert bodies.estimate_tokens(
        {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10}
    ) == (11, 21)
    assert bodies.estimate_tokens({"prompt": "x" * 8})[0] == 3


def _targets(n: int) -> list[Target]:
    downs = DownCount()  # one table's
    return [Target(instance(i + 1, DECODE, 10000 + i), downs) for i in range(n)]


def test_policies() -> None:
    ts = _targets(3)
    rr = RoundRobin()
    assert [rr(ts, ()).id for _ in range(6)] == [1, 2, 3, 1, 2, 3]  # type: ignore[union-attr]
    assert rr(ts, {1, 2, 3}) is None
    ts[0].load, ts[1].load, ts[2].load = 50, 10, 30
    assert least_load(ts, ()) is ts[1]
    assert least_load(ts, {2}) is ts[2]
    picks = Counter(power_of_two(ts, ()).id for _ in range(300))  # type: ignore[union-attr]
    assert picks[1] == 0 and picks[2] > picks[3]  # the most loaded never wins a pair
    # Endpoints out of rotation are skipped, unless nothing else is left.
    ts[1].set_down(ts[1].endpoints[0], True)
    try:
        assert least_load(ts, ()) is ts[2]
        assert least_load(ts, {1, 3}) is ts[1]
    finally:
        ts[1].set_down(ts[1].endpoints[0], False)


def test_view_pairs_by_model_and_protocol_and_keeps_runtime_state() -> None:
    table = RoutingTable()
    sglang = dict(engine_type=c.ENGINE_TYPE_SGLANG)
    table.add([
        instance(1, PREFILL, 10000),
        instance(2, DECODE, 10002, **sglang),  # another protocol: no pair
        instance(3, DECODE, 10004, model="other"),  # another model: no pair
    ])  # fmt: skip
    view = build_view(table.state)
    assert not view.routable
    assert [t.id for t in view.models["motor-sim"].prefill_only] == [1]
    table.add([instance(4, DECODE, 10006)])
    view2 = build_view(table.state, view.targets)
    assert view2.routable and [t.id for t in view2.models["motor-sim"].pd[0].decode] == [4]
    old = next(t for t in view.targets if t.id == 1)
    assert next(t for t in view2.targets if t.id == 1) is old  # load and breaker state survive
    table.set([instance(9, UNION, 10008, 10010)])
    assert build_view(table.state).routable


def test_breaker_never_takes_out_the_last_instance_of_a_role() -> None:
    table = RoutingTable()
    table.add([instance(1, PREFILL, 10000), instance(2, PREFILL, 10002), instance(3, DECODE, 10004)])
    view = build_view(table.state)
    breaker = Breaker(lambda: view)
    p1, p2, d = (next(t for t in view.targets if t.id == i) for i in (1, 2, 3))
    breaker.refused(p1.endpoints[0], "prefill")
    assert p1.endpoints[0].down and view.down_total == 1
    breaker.refused(p2.endpoints[0], "prefill")
    assert not p2.endpoints[0].down  # the last healthy prefill stays
    breaker.refused(d.endpoints[0], "decode")
    assert not d.endpoints[0].down and view.down_total == 1
    table.set([])
    empty = build_view(table.state, view.targets)
    assert not empty.targets and empty.down_total == 0  # retiring p1 clears its mark
    assert RoutingView().routable is False


def test_two_tables_in_one_process_count_and_route_apart() -> None:
    """Two Coordinators in one process (as in the tests): an endpoint out of rotation in one
    table is out of that table's count and routing only."""
    a, b = RoutingTable(), RoutingTable()
    for table in (a, b):  # the same instances, ids and ports in both
        table.add([instance(1, UNION, 10000), instance(2, UNION, 10002)])
    va, vb = build_view(a.state), build_view(b.state)
    down = va.targets[0]
    counts_a: list[int] = []
    counts_b: list[int] = []
    Breaker(lambda: va, counts_a.append).refused(down.endpoints[0], "union")
    assert (va.down_total, vb.down_total) == (1, 0) and counts_a == [1]
    # b's breaker reports b's count (its metrics gauge), a's endpoint not in it.
    Breaker(lambda: vb, counts_b.append).refused(vb.targets[0].endpoints[0], "union")
    assert counts_b == [1]
    vb.targets[0].set_down(vb.targets[0].endpoints[0], False)
    assert not any(ep.down for t in vb.targets for ep in t.endpoints)

    # a routes around its down instance; b, with nothing down, keeps using both of its own.
    ua, ub = va.models[MODEL].union, vb.models[MODEL].union
    rr = RoundRobin()
    assert [rr(ua, ()).id for _ in range(4)] == [2, 2, 2, 2]  # type: ignore[union-attr]
    assert [rr(ub, ()).id for _ in range(4)] == [1, 2, 1, 2]  # type: ignore[union-attr]
    assert {least_load(ub, ()).id for _ in range(50)} == {1, 2}  # type: ignore[union-attr]
    assert all(least_load(ua, ()) is ua[1] for _ in range(50))
    assert all(least_load(ub, ()) in ub and power_of_two(ub, ()) in ub for _ in range(50))

    # The count follows each table from view to view: a change to b leaves a's count alone,
    # and a's down endpoint is still out after a's own rebuild.
    b.add([instance(3, UNION, 10004)])
    vb = build_view(b.state, vb.targets)
    va = build_view(a.state, va.targets)
    assert (va.down_total, vb.down_total) == (1, 0) and va.targets[0] is down
    a.set([instance(2, UNION, 10002)])  # the down instance leaves a
    va = build_view(a.state, va.targets)
    assert (va.down_total, vb.down_total) == (0, 0)
    # A refusal reported late for a target that left b (a request was in flight) counts nowhere.
    gone = vb.targets[0]
    b.set([instance(2, UNION, 10002), instance(3, UNION, 10004)])
    vb = build_view(b.state, vb.targets)
    Breaker(lambda: vb).refused(gone.endpoints[0], "union")
    assert gone.endpoints[0].down and (va.down_total, vb.down_total) == (0, 0)
