"""Standalone mode as a new user tries it (docs/standalone.md): two ``motor engine-sim``
processes, a ``motor coordinator`` with a management key, ``motor register``, the openai SDK and
grpcurl against it. No Controller anywhere."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.coordinator.conftest import ENGINE_ARGS
from tests.procs import Proc, grpcurl, motor_argv

MODEL = "motor-sim"
KEY = "s3cret-standalone-key"
NO_ROUTE = {
    "error": {
        "message": "no routable instance",
        "type": "service_unavailable",
        "param": None,
        "code": "no_routable_instance",
    }
}


@dataclass
class Setup:
    grpc: str
    http: str
    prefill: int
    decode: int
    key_file: Path

    def register(self, *args: str, key: bool = True) -> subprocess.CompletedProcess[str]:
        flags = ["--coordinator", self.grpc, "--timeout", "10"]
        if key:
            flags += ["--key-file", str(self.key_file)]
        return subprocess.run(
            motor_argv("register", *args, *flags), capture_output=True, text=True, timeout=60
        )

    def call(self, method: str, body: object, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
        headers = ["-H", f"x-motor-management-key: {key}"] if key is not None else []
        return grpcurl(*headers, "-d", json.dumps(body), self.grpc, f"motor.v1.Coordinator/{method}")

    def table(self) -> dict[str, object]:
        out = self.call("ListInstances", {})
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def ask(self) -> str:
        client = openai.OpenAI(base_url=f"http://{self.http}/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        return resp.choices[0].message.content or ""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("standalone")
    key_file = tmp / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    cfg = tmp / "coordinator.json"
    cfg.write_text(json.dumps({"management_key_file": str(key_file), "port": 0, "http_port": 0}))
    procs = [
        Proc(motor_argv("engine-sim", "serve", MODEL, "--port", "0", *ENGINE_ARGS[kind]))
        for kind in ("vllm_p", "vllm_d")
    ]
    coordinator = Proc(motor_argv("coordinator", "--config", str(cfg)))
    procs.append(coordinator)
    try:
        ports = [
            int(p.wait_line("event=listening", 30).split("http=")[1].split()[0].rsplit(":", 1)[1])
            for p in procs[:2]
        ]
        grpc_addr, http = coordinator.listening(30)
        assert http is not None
        yield Setup(grpc_addr, http, ports[0], ports[1], key_file)
    finally:
        for p in procs:
            p.kill()


@pytest.fixture
def s(setup: Setup) -> Setup:
    """Every test starts from an empty table."""
    out = setup.call("SetInstances", {"instances": []})
    assert out.returncode == 0, out.stderr
    return setup


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_register_serve_list_delete_as_a_new_user(s: Setup) -> None:
    p, d = f"127.0.0.1:{s.prefill}", f"127.0.0.1:{s.decode}"
    added = s.register("add", "--prefill", p, "--decode", d)
    assert added.returncode == 0, added.stderr
    assert added.stdout.count("added 0x") == 2

    assert s.ask()  # through the prefill then the decode engine

    listed = s.register("list")
    assert listed.returncode == 0, listed.stderr
    rows = [ln for ln in listed.stdout.splitlines() if ln.startswith("available")]
    assert len(rows) == 2 and any(p in r for r in rows) and any(d in r for r in rows)
    as_json = json.loads(s.register("list", "-o", "json").stdout)
    assert {i["job_name"] for i in as_json["available"]} == {
        f"{MODEL}-prefill-127.0.0.1-{s.prefill}",
        f"{MODEL}-decode-127.0.0.1-{s.decode}",
    }

    removed = s.register("del", "--prefill", p, "--decode", d)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.count("deleted 0x") == 2
    assert s.table().get("available") is None

    with pytest.raises(openai.APIStatusError) as err:
        s.ask()
    assert err.value.status_code == 503
    assert err.value.response.json() == NO_ROUTE


def test_dry_run_ids_do_not_depend_on_endpoint_order(s: Setup) -> None:
    def dry(prefill: str) -> dict[str, object]:
        out = s.register("add", "--prefill", prefill, "--no-health-check", "--model-name", "m", "--dry-run")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    before = s.table()
    one = dry("127.0.0.1:10002,127.0.0.1:10000")
    assert one == dry("127.0.0.1:10000,127.0.0.1:10002")
    inst = one["instances"][0]  # type: ignore[index]
    assert [e["port"] for e in inst["endpoints"]] == [10000, 10002]
    assert [e.get("id", 0) for e in inst["endpoints"]] == [0, 1]
    assert inst["job_name"] == "m-prefill-127.0.0.1-10000"
    example = dry("127.0.0.1:10000")["instances"][0]  # type: ignore[index]
    assert int(example["id"]) == 0x71543F99 == 1901346713
    assert s.table() == before  # a dry run sends nothing


def test_register_refusals_change_nothing(s: Setup, tmp_path: Path) -> None:
    p, d = f"127.0.0.1:{s.prefill}", f"127.0.0.1:{s.decode}"
    assert s.register("add", "--prefill", p, "--decode", d).returncode == 0
    before = s.table()
    taken = before["available"][0]["id"]  # type: ignore[index]

    cases = [
        # (argv, exit code, words the one line must contain)
        (["add", "--prefill", p], 0, "unchanged"),  # the same add again: nothing to do
        (["add", "--union", p], 1, "already serves in instance"),
        (
            ["add", "--prefill", "127.0.0.1:1", "--id", taken, "--no-health-check", "--model-name", MODEL],
            1,
            "already held",
        ),
        (
            ["add", "--prefill", "127.0.0.1:1"],
            1,
            "127.0.0.1:1 is not healthy: GET /v1/models: cannot connect",
        ),
        (["add", "--prefill", "127.0.0.1:1", "--no-health-check"], 2, "--model-name is required"),
        (["add", "--prefill", p, "--model-name", "other"], 1, "serves 'motor-sim', not 'other'"),
        (["del", "--id", "0x40000001"], 1, "no instance 0x40000001"),
        (["del", "--decode", p], 1, "no instance"),
        (["set", "--prefill", p, "--union", p], 1, "is in two instances"),
        (["set", "--prefill", p, "--prefill", p], 1, "have the same id"),
    ]
    for argv, code, words in cases:
        out = s.register(*argv)
        assert out.returncode == code, (argv, out.stdout, out.stderr)
        text = out.stdout if code == 0 else out.stderr
        assert words in text, (argv, text)
        if code:
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    nokey = s.register("list", key=False)
    assert nokey.returncode == 1 and "UNAUTHENTICATED" in nokey.stderr

    typo = tmp_path / "typo.json"
    typo.write_text(
        json.dumps({"instances": [{"role": "ROLE_PREFILL", "endpoints": [{"host": "h", "prot": 1}]}]})
    )
    out = s.register("add", "--file", str(typo), "--no-health-check", "--model-name", "m")
    assert out.returncode == 1
    assert "instances[0].endpoints[0].prot: unknown field; did you mean 'port'?" in out.stderr

    assert s.table() == before
    assert s.ask()


def test_grpcurl_against_a_keyed_coordinator(s: Setup) -> None:
    p = {
        "id": "1",
        "role": "ROLE_PREFILL",
        "job_name": "p",
        "model_name": MODEL,
        "endpoints": [{"host": "127.0.0.1", "port": s.prefill}],
    }
    d = {
        **p,
        "id": "2",
        "role": "ROLE_DECODE",
        "job_name": "d",
        "endpoints": [{"host": "127.0.0.1", "port": s.decode}],
    }
    first = s.call("AddInstances", {"instances": [p, d]})
    assert first.returncode == 0, first.stderr
    before = s.table()
    assert s.ask()

    refusals = [
        ("AddInstances", {"instances": [p]}, None, "Unauthenticated"),
        ("AddInstances", {"instances": [p]}, "wrong-key", "PermissionDenied"),
        ("AddInstances", {"instances": [{**p, "id": "7"}, {**d, "id": "7"}]}, KEY, "InvalidArgument"),
        (
            "AddInstances",
            {"instances": [{**p, "endpoints": [{"host": "127.0.0.1", "port": 1}]}]},
            KEY,
            "AlreadyExists",
        ),
        ("ListInstances", {}, None, "Unauthenticated"),
    ]
    for method, body, key, code in refusals:
        out = s.call(method, body, key=key)
        assert out.returncode != 0 and f"Code: {code}" in out.stdout + out.stderr, (method, code, out)
        assert s.table() == before
        assert s.ask()

    again = s.call("AddInstances", {"instances": [p, d]})
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["revision"] == before["revision"]
    assert s.table() == before
    status, _ = _get(f"http://{s.http}/v1/models")
    assert status == 200
