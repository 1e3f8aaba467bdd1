"""What ``motor up --ha`` runs (no process started): an etcd on loopback, two Controllers on it
whose configuration (as each child loads it from its environment) is the etcd store, and
NodeManagers and a Coordinator given both Controllers; without --ha, what ran before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from motor_mesh.cli import up
from motor_mesh.cli.up_args import parse
from motor_mesh.cli.up_output import error_line
from motor_mesh.cli.up_plan import LOST_LEADERSHIP_EXIT, NO_ETCD, Plan, plan
from motor_mesh.common.config import Config, load
from motor_mesh.controller.leader.ha import LOST_LEADERSHIP_EXIT as CONTROLLER_LOST_LEADERSHIP_EXIT

OFF = 1000


def planned(tmp_path: Path, *argv: str, config: dict[str, object] | None = None) -> Plan:
    args = ["--port-offset", str(OFF), *argv]
    if config is not None:
        (tmp_path / "motor.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "motor.json")]
    parsed = parse(args)
    return plan(parsed, load(parsed.config, env={}), tmp_path / "state", "/opt/etcd/bin/etcd")


def loaded(child_env: dict[str, str], config: str | None = None) -> Config:
    """The configuration the child reads: its environment over the file."""
    return load(config, env=child_env)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_ha_starts_an_etcd_on_loopback_with_its_data_in_the_state_dir(tmp_path: Path) -> None:
    p = planned(tmp_path, "--ha")
    assert p.etcd is not None and p.etcd.name == "etcd" and p.etcd.argv[0] == "/opt/etcd/bin/etcd"
    args = dict(a.removeprefix("--").split("=", 1) for a in p.etcd.argv[1:])
    client, peer = f"http://127.0.0.1:{2379 + OFF}", f"http://127.0.0.1:{2380 + OFF}"
    assert args["name"] == "motor-up"
    assert args["data-dir"] == str(tmp_path / "state" / "etcd")
    assert args["listen-client-urls"] == args["advertise-client-urls"] == client
    assert args["listen-peer-urls"] == args["initial-advertise-peer-urls"] == peer
    assert args["initial-cluster"] == f"motor-up={peer}"
    assert args["log-level"] == "warn"
    assert p.etcd_endpoint == f"127.0.0.1:{2379 + OFF}"
    # Stopped by signal, in a session of its own, after the Controllers.
    assert p.etcd.foreign and not any(c.foreign for c in p.children[1:])
    assert p.children[0] is p.etcd


def test_ha_runs_two_controllers_on_the_etcd_store(tmp_path: Path) -> None:
    p = planned(tmp_path, "--ha")
    assert [c.name for c in p.controllers] == ["controller-0", "controller-1"]
    assert p.controller_addrs == [f"127.0.0.1:{7100 + OFF}", f"127.0.0.1:{7101 + OFF}"]
    for i, c in enumerate(p.controllers):
        assert c.argv[3] == "controller"
        assert flag(c.argv, "--port") == str(7100 + i + OFF)
        assert flag(c.argv, "--metrics-port") == str(9100 + i + OFF)
        cfg = loaded(c.env).controller
        assert cfg.store == "etcd"
        assert cfg.etcd_endpoints == (f"127.0.0.1:{2379 + OFF}",)
        assert cfg.etcd_prefix == "/motor"
        assert cfg.coordinators == (f"127.0.0.1:{7200 + OFF}",)
        assert cfg.state_dir == str(tmp_path / "state" / c.name)
        assert cfg.advertise_address == p.controller_addrs[i]
        # A leader that lost its lease exits with this status and comes back as a standby.
        assert c.restart_codes == {LOST_LEADERSHIP_EXIT}
    assert LOST_LEADERSHIP_EXIT == CONTROLLER_LOST_LEADERSHIP_EXIT


def test_ha_clients_are_given_both_controllers(tmp_path: Path) -> None:
    p = planned(tmp_path, "--ha", "--prefill", "1", "--decode", "2")
    both = f"127.0.0.1:{7100 + OFF},127.0.0.1:{7101 + OFF}"
    assert p.controller_target == both
    assert loaded(p.coordinator.env).coordinator.controller == both
    assert [n.name for n in p.nodes] == ["nm-0", "nm-1", "nm-2"]
    for i, n in enumerate(p.nodes):
        assert loaded(n.env).nodemanager.controller == both
        assert flag(n.argv, "--port") == str(7300 + i + OFF)


def test_ha_keeps_the_other_settings_of_the_configuration(tmp_path: Path) -> None:
    config = {
        "controller": {
            "instance_heartbeat_timeout_s": 42,
            "leader_lease_s": 3,
            "metrics_port": 9500,
            "etcd_ca_file": "/elsewhere/ca.pem",
        }
    }
    p = planned(tmp_path, "--ha", config=config)
    for i, c in enumerate(p.controllers):
        assert flag(c.argv, "--config") == str(tmp_path / "motor.json")
        cfg = loaded(c.env, str(tmp_path / "motor.json")).controller
        assert cfg.instance_heartbeat_timeout_s == 42 and cfg.leader_lease_s == 3
        assert flag(c.argv, "--metrics-port") == str(9500 + i + OFF)
        assert cfg.etcd_ca_file == ""  # our etcd speaks plaintext


def test_ha_controllers_on_a_wildcard_host_advertise_loopback(tmp_path: Path) -> None:
    p = planned(tmp_path, "--ha", config={"controller": {"host": "0.0.0.0"}})
    assert p.controller_addrs == [f"127.0.0.1:{7100 + OFF}", f"127.0.0.1:{7101 + OFF}"]
    for c, addr in zip(p.controllers, p.controller_addrs, strict=True):
        cfg = loaded(c.env, str(tmp_path / "motor.json")).controller
        assert cfg.host == "0.0.0.0" and cfg.advertise_address == addr
    assert loaded(p.coordinator.env, str(tmp_path / "motor.json")).coordinator.controller == ",".join(
        p.controller_addrs
    )


def test_etcd_variables_of_our_environment_do_not_reach_etcd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_NAME", "other")
    p = planned(tmp_path, "--ha")
    assert p.etcd is not None and "ETCD_NAME" not in p.etcd.env
    assert p.controllers[0].env["ETCD_NAME"] == "other"


def test_without_ha_nothing_changes(tmp_path: Path) -> None:
    p = planned(tmp_path)
    assert p.etcd is None and p.etcd_endpoint == ""
    assert [c.name for c in p.children] == ["controller", "coordinator", "nm-0", "nm-1"]
    (c,) = p.controllers
    assert flag(c.argv, "--port") == str(7100 + OFF) and flag(c.argv, "--metrics-port") == str(9100 + OFF)
    assert c.restart_codes == frozenset()
    cfg = loaded(c.env).controller
    assert cfg.store == "sqlite" and cfg.state_dir == str(tmp_path / "state" / "controller")
    assert loaded(p.coordinator.env).coordinator.controller == f"127.0.0.1:{7100 + OFF}"
    assert {loaded(n.env).nodemanager.controller for n in p.nodes} == {f"127.0.0.1:{7100 + OFF}"}


def test_ha_without_etcd_installed_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(up, "etcd_binary", lambda: None)
    assert up.main(["--ha"]) == 1
    assert capsys.readouterr().err == NO_ETCD + "\n"


def test_help_names_the_controllers_to_give_operator_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--ha" in out and "--controller 127.0.0.1:7100,127.0.0.1:7101" in out


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            b'{"level":"fatal","ts":"x","msg":"discovery failed","error":"listen tcp: bind: address'
            b' already in use","stacktrace":"a\\nb"}\n',
            "discovery failed: listen tcp: bind: address already in use",
        ),
        (b'{"level":"warn","ts":"x","msg":"simple token is not cryptographically signed"}\n', None),
    ],
)
def test_the_error_line_of_etcd(line: bytes, expected: str | None) -> None:
    assert error_line(line) == expected
