"""What ``motor register`` derives and refuses, without any process (services/cli/standalone.py,
services/cli/table_checks.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from motor_mesh.cli import register
from motor_mesh.cli import standalone as sa
from motor_mesh.cli import table_checks as checks
from motor_mesh.gen.motor.v1 import common_pb2


def test_the_documented_example() -> None:
    assert sa.derive_id("prefill", [("127.0.0.1", 10000)]) == 0x71543F99 == 1901346713


@given(
    st.sampled_from(["prefill", "decode", "union"]),
    st.lists(
        st.tuples(st.sampled_from(["10.0.0.2", "10.0.0.10", "Node-A", "::1"]), st.integers(1, 65535)),
        min_size=1,
        max_size=6,
        unique=True,
    ),
    st.randoms(),
)
def test_ids_ignore_order_and_host_case_and_stay_in_the_high_namespace(
    role: str, endpoints: list[tuple[str, int]], rnd: object
) -> None:
    shuffled = list(endpoints)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    upper = [(h.upper(), p) for h, p in shuffled]
    iid = sa.derive_id(role, endpoints)
    assert iid == sa.derive_id(role, shuffled) == sa.derive_id(role, upper)
    assert sa.STANDALONE_BIT <= iid < 2 * sa.STANDALONE_BIT


def test_roles_give_different_ids() -> None:
    eps = [("127.0.0.1", 10000)]
    assert len({sa.derive_id(r, eps) for r in ("prefill", "decode", "union")}) == 3


def test_build_numbers_endpoints_in_sorted_order_and_names_the_job() -> None:
    spec = sa.parse_instance("decode", "10.0.0.2:9000:9001,10.0.0.10:8000,10.0.0.2:8000")
    inst = sa.build(spec, "llama", "sglang", "", 0)
    assert [(e.id, e.host, e.port) for e in inst.endpoints] == [
        (0, "10.0.0.10", 8000),
        (1, "10.0.0.2", 8000),
        (2, "10.0.0.2", 9000),
    ]
    assert inst.endpoints[2].bootstrap_port == 9001
    assert inst.job_name == "llama-decode-10.0.0.10-8000"
    assert inst.pd_protocol == common_pb2.PD_PROTOCOL_SGLANG
    assert inst.parallel.dp == 3
    assert inst.id == sa.derive_id("decode", [("10.0.0.2", 8000), ("10.0.0.10", 8000), ("10.0.0.2", 9000)])
    assert sa.build(spec, "llama", "sim", "", 0).pd_protocol == common_pb2.PD_PROTOCOL_VLLM
    assert sa.build(spec, "llama", "sim", "sglang", 0).pd_protocol == common_pb2.PD_PROTOCOL_SGLANG
    assert sa.build(spec, "llama", "vllm", "", 42).id == 42


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("h", "expected HOST:PORT"),
        ("h:0", "port must be 1..65535"),
        ("h:70000", "port must be 1..65535"),
        ("h:80:x", "bootstrap port must be 1..65535"),
        ("h:80:81:82", "expected HOST:PORT"),
        ("[::1]80", "expected [IPV6]"),
        (":80", "expected HOST:PORT"),
    ],
)
def test_bad_endpoints_are_explained(text: str, words: str) -> None:
    with pytest.raises(sa.InputError, match=words.replace("[", r"\[")):
        sa.parse_endpoint(text)


def test_ipv6_and_duplicates() -> None:
    assert sa.parse_endpoint("[::1]:8000:8001") == sa.EndpointSpec("::1", 8000, 8001)
    assert sa.EndpointSpec("::1", 8000).address == "[::1]:8000"
    with pytest.raises(sa.InputError, match="named twice"):
        sa.parse_instance("prefill", "H:1,h:1")


def test_json_input_names_a_misspelled_field_at_any_depth() -> None:
    text = json.dumps(
        {"instances": [{"role": "ROLE_PREFILL", "endpoints": [{"host": "h", "prot": 1}], "jobname": "x"}]}
    )
    with pytest.raises(sa.InputError) as err:
        sa.parse_json(text, "in.json")
    msg = str(err.value)
    assert "instances[0].endpoints[0].prot: unknown field; did you mean 'port'?" in msg
    assert "instances[0].jobname: unknown field; did you mean 'job_name'?" in msg
    with pytest.raises(sa.InputError, match="instancs: unknown field; did you mean 'instances'"):
        sa.parse_json('{"instancs": []}', "in.json")
    with pytest.raises(sa.InputError, match=r"in.json:1:2: invalid JSON"):
        sa.parse_json("{,", "in.json")


def test_json_input_round_trips_what_dry_run_prints() -> None:
    inst = sa.build(sa.parse_instance("union", "h:1"), "m", "vllm", "", 0)
    assert sa.parse_json(sa.to_json([inst]), "x") == [inst]
    camel = json.dumps(
        [{"id": "5", "role": "ROLE_UNION", "jobName": "j", "endpoints": [{"host": "h", "port": 1}]}]
    )
    assert sa.parse_json(camel, "x")[0].job_name == "j"


def _held(*instances: common_pb2.Instance) -> checks.Held:
    return {i.id: i for i in instances}


def test_conflict_checks() -> None:
    p = sa.build(sa.parse_instance("prefill", "h:1"), "m", "vllm", "", 0)
    held = _held(p)
    checks.refuse_add_conflicts([p], held)  # the same instance again: fine, nothing changes
    other = sa.build(sa.parse_instance("prefill", "h:2"), "m", "vllm", "", p.id)
    with pytest.raises(sa.InputError, match="already held by"):
        checks.refuse_add_conflicts([other], held)
    same_engine = sa.build(sa.parse_instance("decode", "h:1"), "m", "vllm", "", 0)
    with pytest.raises(sa.InputError, match="h:1 already serves in instance"):
        checks.refuse_add_conflicts([same_engine], held)
    with pytest.raises(sa.InputError, match="in two instances"):
        checks.refuse_overlaps([p, same_engine])

    managed = common_pb2.Instance(id=3, role=common_pb2.ROLE_DECODE)
    with pytest.raises(sa.InputError, match="a Controller manages"):
        checks.refuse_set_conflicts(_held(managed, p), force=False)
    checks.refuse_set_conflicts(_held(managed, p), force=True)
    checks.refuse_set_conflicts(held, force=False)


def test_delete_reads_the_stored_identity() -> None:
    p = sa.build(sa.parse_instance("prefill", "h:1,h:2"), "m", "vllm", "", 0)
    spec = sa.parse_instance("prefill", "H:2,h:1")
    assert checks.delete_targets([(p.id, spec)], _held(p), "c") == [p]
    assert checks.delete_targets([(p.id, None)], _held(p), "c") == [p]
    with pytest.raises(sa.InputError, match="no instance"):
        checks.delete_targets([(p.id + 1, None)], _held(p), "c")
    moved = sa.build(sa.parse_instance("prefill", "h:3"), "m", "vllm", "", p.id)
    with pytest.raises(sa.InputError, match="is held by"):
        checks.delete_targets([(p.id, spec)], _held(moved), "c")
    sent = checks.identity_only(p)
    assert (sent.id, sent.job_name, sent.model_name) == (p.id, p.job_name, "")


def test_a_dry_run_shows_what_the_coordinator_would_refuse(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["add", "--engine-type", "sglang", "--no-health-check", "--model-name", "m", "--dry-run"]
    assert register.main([*base, "--prefill", "127.0.0.1:30000"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "motor register add: instances[0].endpoints[0].bootstrap_port: required for an SGLang prefill endpoint"
    )
    assert register.main([*base, "--prefill", "127.0.0.1:30000:30001"]) == 0
    sent = json.loads(capsys.readouterr().out)["instances"][0]
    assert sent["endpoints"][0]["bootstrap_port"] == 30001
    assert sent["pd_protocol"] == "PD_PROTOCOL_SGLANG"
