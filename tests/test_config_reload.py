"""The keys that may change while the services run (common/config/reloadable.py), the comparison
of a new configuration with the running one, and reading a file sent as text the way a service
read its own (common/config/source.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.common.config import SECTIONS, ConfigError, load, reloadable
from motor_mesh.common.config.sections import SCHEMA, SECTION_TYPES, RateLimit
from motor_mesh.common.config.source import Source, motor_env


def sectioned(**sections: dict[str, Any]) -> str:
    return json.dumps(sections)


def test_every_whitelisted_key_exists_and_every_section_reloads_its_log_level() -> None:
    assert set(reloadable.WHITELIST) == set(SECTIONS)
    for section, keys in reloadable.WHITELIST.items():
        assert "log_level" in keys
        assert keys <= set(SCHEMA[section]), keys - set(SCHEMA[section])
    # What binds, opens or sizes something at start never reloads.
    for key in (
        "port",
        "http_port",
        "workers",
        "host",
        "tls_cert_file",
        "management_key_file",
        "api_keys_file",
    ):
        assert not reloadable.reloadable("coordinator", key)
    for key in ("port", "state_dir", "store", "coordinators", "heartbeat_interval_s"):
        assert not reloadable.reloadable("controller", key)


def test_diff_names_reloadable_changes_with_their_json_values_and_refuses_the_rest() -> None:
    running = load(None, env={})
    new = load(
        None,
        env={},
        text=sectioned(
            coordinator={
                "queue_timeout_s": 5,
                "rate_limit": {"max_requests": 10},
                "http_port": 9000,
                "port": 9001,
            },
            controller={"log_level": "debug", "state_dir": "/elsewhere"},
            nodemanager={"log_level": "warning"},
        ),
    )
    changed, refused = reloadable.diff(running, new)
    assert changed == {
        "coordinator": {
            "queue_timeout_s": 5,
            "rate_limit": {
                **dataclasses.asdict(RateLimit()),
                "max_requests": 10,
                "skip_paths": list(RateLimit().skip_paths),
            },
        },
        "controller": {"log_level": "debug"},
        "nodemanager": {"log_level": "warning"},
    }
    assert refused == ["controller.state_dir", "coordinator.http_port", "coordinator.port"]
    assert reloadable.keys_of(changed) == [
        "controller.log_level",
        "coordinator.queue_timeout_s",
        "coordinator.rate_limit",
        "nodemanager.log_level",
    ]
    # Limited to the sections asked about (SIGHUP: the service's own).
    assert reloadable.diff(running, new, ("nodemanager",)) == ({"nodemanager": {"log_level": "warning"}}, [])


def test_the_same_values_written_otherwise_change_nothing() -> None:
    running = load(None, env={}, text=sectioned(coordinator={"queue_timeout_s": 30.0, "rate_limit": {}}))
    same = load(None, env={}, text=sectioned(coordinator={"queue_timeout_s": 30}))
    assert reloadable.diff(running, same) == ({}, [])


def test_checked_types_pushed_values_and_names_every_problem() -> None:
    values = reloadable.values_of(load(None, env={}).coordinator, "coordinator")
    assert set(values) == reloadable.WHITELIST["coordinator"]
    json.dumps(values)  # plain JSON
    values.update(
        queue_timeout_s=2.5, rate_limit={"max_requests": 3, "window_s": 1}, prefill_policy="round_robin"
    )
    typed, problems = reloadable.checked("coordinator", values)
    assert problems == []
    cfg = dataclasses.replace(load(None, env={}).coordinator, **typed)
    assert cfg.queue_timeout_s == 2.5 and cfg.prefill_policy == "round_robin"
    assert cfg.rate_limit == RateLimit(max_requests=3, window_s=1)
    _, problems = reloadable.checked(
        "coordinator",
        {"http_port": 1, "queue_timeout_s": -1, "rate_limit": {"max_requests": "x"}, "nope": 1},
    )
    assert problems == [
        ("http_port", "not a reloadable key (it needs a restart)"),
        ("queue_timeout_s", "must be greater than 0 and at most 604800, got -1"),
        ("rate_limit.max_requests", 'expected integer, got string "x"'),
        ("nope", "unknown key"),
    ]


def test_the_loader_reads_text_as_it_reads_a_file(tmp_path: Path) -> None:
    text = sectioned(coordinator={"queue_timeout_s": 7})
    path = tmp_path / "cfg.json"
    path.write_text(text)
    assert load(str(path), env={}) == load("cfg.json", env={}, text=text)
    assert load(None, env={}, text="\ufeff" + text).coordinator.queue_timeout_s == 7  # a BOM, as utf-8-sig
    with pytest.raises(ConfigError) as err:
        load("sent.json", env={}, text='{"coordinator": {"portt": 1}}')
    assert err.value.errors == ["sent.json: coordinator.portt: unknown key; did you mean 'port'?"]
    with pytest.raises(ConfigError) as err:
        load(None, env={}, text="{")
    assert err.value.errors[0].startswith("config:1:2: invalid JSON")


def test_a_source_reads_a_new_file_with_its_own_flags_and_environment_on_top(tmp_path: Path) -> None:
    """A key a flag or a variable set at start is not a change a reload could make or refuse."""
    env = motor_env({"MOTOR_COORDINATOR_HTTP_PORT": "9000", "PATH": "/bin", "HOME": "/root"})
    assert env == {"MOTOR_COORDINATOR_HTTP_PORT": "9000"}
    path = tmp_path / "cfg.json"
    path.write_text(sectioned(coordinator={"queue_timeout_s": 30}))
    overrides = {"coordinator": {"port": 7201}}
    start = load(str(path), section="coordinator", env=env, overrides=overrides)
    source = Source("coordinator", str(path), start, overrides=overrides, env=env)
    edited = sectioned(coordinator={"queue_timeout_s": 5, "http_port": 8000, "port": 7200})
    new = source.load(edited)
    assert (new.coordinator.http_port, new.coordinator.port) == (9000, 7201)
    assert reloadable.diff(start, new) == ({"coordinator": {"queue_timeout_s": 5}}, [])
    path.write_text(edited)
    assert source.load() == new  # the file itself, re-read (SIGHUP)


@pytest.mark.parametrize("section", list(SECTION_TYPES))
def test_the_default_of_every_reloadable_key_passes_its_check(section: str) -> None:
    values = reloadable.values_of(load(None, env={}).section(section), section)
    assert reloadable.checked(section, values)[1] == []
