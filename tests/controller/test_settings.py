"""ReloadConfig on an in-process Controller over real gRPC (controller/settings.py): reloadable
changes are stored under a new revision, applied to the Controller at once and pushed to every
Coordinator (ApplySettings, with the replicas); a file that changes anything else, or is not a
valid configuration, changes nothing; a write the disk refuses changes nothing; a restart goes on
with the stored settings; a Coordinator that predates ApplySettings or refuses it leaves the
table push alone. The SQLite record round-trips and a damaged one stops the start. (The etcd
store: e2e/test_settings_etcd.py; real processes: tests/e2e/test_config_reload*.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.cli import config_cmd
from motor_mesh.common.config import Config
from motor_mesh.common.config.sections import to_json
from motor_mesh.common.errors import RpcFailure, details_of
from motor_mesh.controller.app import Controller
from motor_mesh.controller.store.db import StateCorrupt
from motor_mesh.controller.store.interface import StoredSettings
from motor_mesh.controller.store.sqlite import Store
from motor_mesh.gen.motor.v1 import controller_pb2
from tests.controller.fakes import FakeCoordinator, Harness, controller_cfg, running_controller
from tests.controller.test_desired import FullDisk
from tests.poll import until


def config_text(running: Config, **changes: dict[str, Any]) -> str:
    """The running configuration as a sectioned file, with ``changes`` (by section) made."""
    doc = {
        name: {k: to_json(v) for k, v in vars(running.section(name)).items()}
        for name in ("controller", "coordinator", "nodemanager", "engine")
    }
    for name, values in changes.items():
        doc[name].update(values)
    return json.dumps(doc)


async def reload(h: Harness, **changes: dict[str, Any]) -> controller_pb2.ReloadConfigResponse:
    text = config_text(h.controller.settings.running, **changes)
    resp: controller_pb2.ReloadConfigResponse = await h.stub.ReloadConfig(
        controller_pb2.ReloadConfigRequest(config_text=text), timeout=5
    )
    return resp


def refused_keys(err: grpc.aio.AioRpcError) -> list[str]:
    return [
        v.subject
        for d in details_of(err)
        if isinstance(d, error_details_pb2.PreconditionFailure)
        for v in d.violations
        if v.type == "NOT_RELOADABLE"
    ]


async def test_a_reload_is_stored_applied_and_pushed(
    tmp_path: Path, coordinator: FakeCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        c = h.controller
        # Before any reload: revision 0 and "keep your own file's values", with the replicas.
        await until(lambda: coordinator.settings)
        assert (coordinator.settings[0].settings_revision, coordinator.settings[0].settings_json) == (0, "")
        assert coordinator.settings[0].replicas == 1
        resp = await reload(
            h,
            controller={
                "instance_heartbeat_timeout_s": 4,
                "engine_relaunch_poll_interval_s": 2,
                "log_level": "debug",
            },
            coordinator={"queue_timeout_s": 5, "rate_limit": {"max_requests": 7}},
        )
        assert resp.settings_revision == 1
        assert list(resp.changed_keys) == [
            "controller.engine_relaunch_poll_interval_s",
            "controller.instance_heartbeat_timeout_s",
            "controller.log_level",
            "coordinator.queue_timeout_s",
            "coordinator.rate_limit",
        ]
        # The Controller's own keys, at once, where they are read.
        assert c.cfg.instance_heartbeat_timeout_s == 4
        assert c.hub.timeout_s == 4 and c.instances.heartbeat_timeout_s == 4
        assert c.assembler.heartbeat_timeout_s == 4 and c.registrar.heartbeat_timeout_s == 4
        assert c.faults.strategies["EngineRelaunch"].poll_s == 2  # type: ignore[attr-defined]
        assert logging.getLogger().level == logging.DEBUG
        # Every Coordinator gets the revision and every reloadable coordinator key.
        await until(lambda: coordinator.settings[-1].settings_revision == 1)
        pushed = json.loads(coordinator.settings[-1].settings_json)
        assert pushed["queue_timeout_s"] == 5 and pushed["rate_limit"]["max_requests"] == 7
        assert pushed["prefill_timeout_s"] == 300  # unchanged keys too: every replica runs the same
        # Stored before it was applied.
        stored = c.store.load_settings()
        assert stored is not None and stored.revision == 1
        assert (
            stored.coordinator["queue_timeout_s"] == 5
            and stored.controller["instance_heartbeat_timeout_s"] == 4
        )
        # The same file again changes nothing, and nothing is pushed again.
        pushes = len(coordinator.settings)
        again = await reload(h)
        assert (again.settings_revision, list(again.changed_keys)) == (1, [])
        assert len(coordinator.settings) == pushes
    lines = [r.fields for r in caplog.records if getattr(r, "event", "") == "config_reloaded"]
    assert lines == [{"via": "rpc", "revision": 1, "changed": ",".join(resp.changed_keys)}]


async def test_with_a_tenants_file_every_reload_has_the_coordinators_read_it_again(
    tmp_path: Path, coordinator: FakeCoordinator
) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        first = await reload(h, coordinator={"tenants_file": "/etc/motor/tenants.json"})
        assert (first.settings_revision, list(first.changed_keys)) == (1, ["coordinator.tenants_file"])
        again = await reload(h)  # the same file: what the tenants file holds may have changed
        assert (again.settings_revision, list(again.changed_keys)) == (2, ["coordinator.tenants_file"])
        await until(lambda: coordinator.settings[-1].settings_revision == 2)
        stored = h.controller.store.load_settings()
        assert stored is not None and stored.revision == 2


async def test_a_change_that_needs_a_restart_is_refused_and_nothing_applies(
    tmp_path: Path, coordinator: FakeCoordinator
) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await reload(h, coordinator={"queue_timeout_s": 9})
        before = h.controller.settings.running
        await until(lambda: coordinator.settings and coordinator.settings[-1].settings_revision == 1)
        pushes = len(coordinator.settings)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reload(
                h,
                coordinator={"queue_timeout_s": 1, "http_port": 9999},
                controller={"log_level": "error", "state_dir": str(tmp_path / "other")},
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused_keys(err.value) == ["controller.state_dir", "coordinator.http_port"]
        assert "coordinator.http_port" in (err.value.details() or "")
        assert RpcFailure.of(err.value).reason == "NOT_RELOADABLE"
        # Nothing of it applied: not the reloadable keys either.
        assert h.controller.settings.running == before and h.controller.settings.revision == 1
        assert h.controller.cfg.log_level == "info" and logging.getLogger().level != logging.ERROR
        stored = h.controller.store.load_settings()
        assert stored is not None and (stored.revision, stored.coordinator["queue_timeout_s"]) == (1, 9)
        assert len(coordinator.settings) == pushes


@pytest.mark.parametrize(
    ("text", "problems"),
    [
        ("{", ["config:1:2: invalid JSON: Expecting property name enclosed in double quotes"]),
        (
            '{"coordinator": {"queue_timeout_s": -1, "portt": 1}}',
            [
                "config: coordinator.queue_timeout_s: must be greater than 0 and at most 604800, got -1",
                "config: coordinator.portt: unknown key; did you mean 'port'?",
            ],
        ),
        ("[]", ["config: expected a JSON object at the top level, got array"]),
        ("   ", ["required: the configuration file's text"]),
    ],
)
async def test_a_file_that_is_not_a_configuration_is_invalid_argument(
    tmp_path: Path, text: str, problems: list[str]
) -> None:
    async with running_controller(tmp_path) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.ReloadConfig(controller_pb2.ReloadConfigRequest(config_text=text), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations = [
            (v.field, v.description)
            for d in details_of(err.value)
            if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations
        ]
        assert violations == [("config_text", p) for p in problems]
        assert h.controller.settings.revision == 0


async def test_a_write_the_disk_refuses_changes_nothing(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await until(lambda: coordinator.settings)
        disk = FullDisk(h.controller)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reload(h, coordinator={"queue_timeout_s": 3}, controller={"start_command_retries": 9})
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert RpcFailure.of(err.value).reason == "STATE_WRITE_FAILED"
        assert h.controller.settings.revision == 0 and h.controller.cfg.start_command_retries == 3
        assert h.controller.instances.start_retries == 3
        assert [s.settings_revision for s in coordinator.settings] == [0]
        disk.lift()
        assert (await reload(h, coordinator={"queue_timeout_s": 3})).settings_revision == 1


async def test_a_restart_goes_on_with_the_stored_settings(
    tmp_path: Path, coordinator: FakeCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await reload(h, coordinator={"decode_idle_timeout_s": 11}, controller={"start_command_retries": 5})
        await reload(h, coordinator={"decode_idle_timeout_s": 12})
    coordinator.restart_state()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        c = h.controller
        assert c.settings.revision == 2 and c.cfg.start_command_retries == 5
        assert c.instances.start_retries == 5
        # Pushed as stored, to the Coordinator the new Controller process has never told anything.
        await until(lambda: coordinator.settings[-1].settings_revision == 2)
        assert json.loads(coordinator.settings[-1].settings_json)["decode_idle_timeout_s"] == 12
        assert (await reload(h, coordinator={"decode_idle_timeout_s": 13})).settings_revision == 3
    restored = [r.fields for r in caplog.records if getattr(r, "event", "") == "settings_restored"]
    assert restored[0] == {
        "revision": 2,
        "over_file": "controller.start_command_retries,coordinator.decode_idle_timeout_s",
    }


async def test_replicas_count_the_reachable_coordinators(tmp_path: Path) -> None:
    a, b = await FakeCoordinator().start(), await FakeCoordinator().start()
    try:
        async with running_controller(tmp_path, coordinators=[a.address, b.address]) as h:
            await until(lambda: a.settings and a.settings[-1].replicas == 2)
            await until(lambda: b.settings and b.settings[-1].replicas == 2)
            await b.stop()
            await until(lambda: a.settings[-1].replicas == 1)
            assert h.controller.coordinators.replicas == 1
    finally:
        await a.stop()
        await b.stop()


async def test_a_coordinator_that_predates_or_refuses_settings_still_gets_its_table(
    tmp_path: Path, coordinator: FakeCoordinator
) -> None:
    coordinator.refuse_settings = grpc.StatusCode.UNIMPLEMENTED
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        pusher = h.controller.coordinators.pushers[coordinator.address]
        await until(lambda: pusher.settings_acked is not None)  # taken as "its own file's"
        await until(lambda: coordinator.count("Set", ok=True) >= 1)
        coordinator.refuse_settings = grpc.StatusCode.FAILED_PRECONDITION
        await reload(h, coordinator={"queue_timeout_s": 4})
        await until(lambda: pusher._settings_refused is not None)
        assert pusher.settings_acked is not None and pusher.settings_acked[0] == 0
        coordinator.refuse_settings = None
        pusher.resync()  # what the periodic resync does: refused settings are offered again
        h.controller.coordinators.settings_changed()
        await until(lambda: coordinator.settings and coordinator.settings[-1].settings_revision == 1)


async def test_the_sqlite_record_round_trips(tmp_path: Path) -> None:
    store = Store(tmp_path)
    assert store.load_settings() is None
    record = StoredSettings(
        3, {"queue_timeout_s": 5, "rate_limit": {"max_requests": 1}}, {"log_level": "debug"}
    )
    await store.save_settings(record)
    await store.save_settings(StoredSettings(4, record.coordinator, {"log_level": "info"}))
    await store.close()
    store = Store(tmp_path)
    assert store.load_settings() == StoredSettings(4, record.coordinator, {"log_level": "info"})
    await store.close()
    db = sqlite3.connect(tmp_path / "controller.db")
    db.execute("UPDATE settings SET coordinator='[1]'")
    db.commit()
    db.close()
    with pytest.raises(StateCorrupt):
        Store(tmp_path).load_settings()


async def test_a_stored_key_this_version_no_longer_reloads_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path)
    await store.save_settings(
        StoredSettings(2, {"http_port": 1, "queue_timeout_s": 6}, {"log_level": "info"})
    )
    await store.close()
    async with running_controller(tmp_path) as h:
        assert h.controller.settings.revision == 2
        assert h.controller.settings.running.coordinator.queue_timeout_s == 6
        assert h.controller.settings.running.coordinator.http_port == 8000
    skipped = [r.fields for r in caplog.records if getattr(r, "event", "") == "settings_restore_skipped"]
    assert skipped == [
        {"setting": "coordinator.http_port", "reason": "not a reloadable key (it needs a restart)"}
    ]


async def test_an_in_process_controller_compares_with_the_defaults_of_the_other_sections(
    tmp_path: Path,
) -> None:
    c = Controller(controller_cfg(tmp_path))
    try:
        assert c.settings.running.controller == c.cfg
        assert c.settings.running.coordinator.http_port == 8000
    finally:
        await c.stop()


async def test_the_cli_prints_one_line_and_names_every_refused_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_controller(tmp_path / "state") as h:
        running = h.controller.settings.running
        path = tmp_path / "cfg.json"

        def run(*extra: str) -> int:
            return config_cmd.main(["reload", str(path), "--controller", h.target, *extra])

        path.write_text(config_text(running, coordinator={"queue_timeout_s": 3}))
        assert await asyncio.to_thread(run) == 0
        assert capsys.readouterr() == ("settings revision 1: coordinator.queue_timeout_s\n", "")
        assert await asyncio.to_thread(run, "-o", "json") == 0
        assert json.loads(capsys.readouterr().out) == {"settings_revision": 1, "changed_keys": []}
        # More keys than a status carries details for: the line still names every one.
        ports = {k: 2 for k in ("port", "http_port", "workers", "max_json_depth")}
        ports["max_body_bytes"] = 2048
        ports.update(engine_metrics_interval_s=1, engine_metrics_stale_s=2, kv_index_max_blocks=3)
        path.write_text(config_text(running, coordinator=ports, controller={"metrics_port": 1}))
        assert await asyncio.to_thread(run) == 1
        out, err = capsys.readouterr()
        assert out == ""
        [line] = err.splitlines()
        keys = ["controller.metrics_port", *sorted(f"coordinator.{k}" for k in ports)]
        assert (
            line
            == f"motor config reload: refused, nothing was applied: these keys need a restart: {', '.join(keys)}"
        )
        # A file with mistakes is not sent: each said as `motor config check` says it.
        path.write_text('{"coordinator": {"portt": 1}}')
        assert await asyncio.to_thread(run) == 1
        assert capsys.readouterr().err == f"{path}: coordinator.portt: unknown key; did you mean 'port'?\n"
        assert h.controller.settings.revision == 1
