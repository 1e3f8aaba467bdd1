"""Configuration loading (docs/configuration.md) and ``motor config check``."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from motor_mesh.cli import config_cmd
from motor_mesh.common.config import DEFAULTS, SECTIONS, ConfigError, load_config, read_key_file

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "deploy" / "config.sample.json"

COMMON = {
    "host",
    "management_key_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_ca_file",
    "max_message_bytes",
    "log_format",
    "log_level",
}
# Transcribed from the public list of keys, so the schema cannot drift from it silently.
CONTRACT_KEYS = {
    "controller": """port coordinators state_dir heartbeat_interval_s instance_heartbeat_timeout_s
        instance_assemble_timeout_s start_command_retries coordinator_set_sync_interval_s
        enable_engine_relaunch engine_relaunch_complete_timeout_s engine_relaunch_poll_interval_s
        engine_relaunch_dispatch_retries engine_relaunch_nm_unreachable_threshold
        precision_auto_recovery_enabled alarm_webhook_url coordinator_key_file nodemanager_key_file
        metrics_port store etcd_endpoints etcd_prefix leader_lease_s
        etcd_ca_file etcd_cert_file etcd_key_file advertise_address planner""",
    "coordinator": """port http_port workers max_concurrent_requests max_queued_requests queue_timeout_s
        prefill_timeout_s decode_first_byte_timeout_s decode_idle_timeout_s max_body_bytes
        max_json_depth prefill_policy decode_policy kv_prefix_weight kv_load_weight
        kv_index_max_blocks kv_load_gate kv_affinity_load_gate_topn kv_events_stale_s
        pd_min_prompt_tokens tokenizers api_keys_file tenants_file rate_limit clamp_max_tokens
        congestion_raise_s controller
        controller_key_file precision_check_enabled precision_interval_s precision_logprobs
        precision_issue_threshold precision_clear_threshold precision_probe_question
        precision_probe_expected probe_max_attempts probe_timeout_s migration_limit migration_delay_s
        max_migration_state_bytes max_migration_state_total_bytes drain_grace_s
        engine_metrics_interval_s engine_metrics_stale_s""",
    "nodemanager": """port controller controller_key_file job_name role model served_model_name
        engine_type sim_protocol ports device_count device_env cpu_cores ucx_port_range pod_index node_rank parallel state_dir
        status_poll_interval_s status_probe_timeout_s max_probe_failures engine_startup_timeout_s
        engine_hang_timeout_s engine_probe_inference probe_inference_interval_s probe_inference_failures
        engine_stop_grace_s drain_wait_s suicide_check_interval_s suicide_threshold
        engine_restart_wait_timeout_s engine_restart_freeze_s metrics_port""",
    "engine": "args kv_connector kv_transfer_config env cpu_kvcache_space_gib data_parallel_group",
}


def write(tmp_path: Path, content: Any, name: str = "cfg.json") -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def nearest(key: str, section: str) -> str:
    return difflib.get_close_matches(key, list(DEFAULTS[section]), n=1, cutoff=0)[0]


def errors_of(*args: Any, **kwargs: Any) -> list[str]:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


# --- schema and sample --------------------------------------------------------------------------


def test_defaults_hold_exactly_the_contract_keys() -> None:
    assert tuple(DEFAULTS) == SECTIONS
    for section, keys in CONTRACT_KEYS.items():
        assert set(DEFAULTS[section]) == set(keys.split()) | COMMON, section


def test_contract_defaults() -> None:
    assert DEFAULTS["controller"]["port"] == 7100
    assert DEFAULTS["controller"]["coordinators"] == ["127.0.0.1:7200"]
    assert DEFAULTS["controller"]["enable_engine_relaunch"] is True
    assert DEFAULTS["coordinator"]["http_port"] == 8000
    assert {
        k: DEFAULTS["coordinator"][k] for k in ("workers", "max_concurrent_requests", "max_queued_requests")
    } == {
        "workers": 0,
        "max_concurrent_requests": 4096,
        "max_queued_requests": 4096,
    }
    assert [
        DEFAULTS["coordinator"][k]
        for k in (
            "queue_timeout_s",
            "prefill_timeout_s",
            "decode_first_byte_timeout_s",
            "decode_idle_timeout_s",
        )
    ] == [30, 300, 300, 120]
    assert (DEFAULTS["coordinator"]["max_body_bytes"], DEFAULTS["coordinator"]["max_json_depth"]) == (
        1 << 26,
        64,
    )
    assert (
        DEFAULTS["coordinator"]["prefill_policy"] == DEFAULTS["coordinator"]["decode_policy"] == "least_load"
    )
    assert DEFAULTS["nodemanager"]["parallel"] == {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "nnodes": 1}
    assert DEFAULTS["nodemanager"]["served_model_name"] == ""
    engine = DEFAULTS["engine"]
    assert (engine["args"], engine["kv_connector"], engine["env"]) == ({}, "NixlConnector", {})
    for section in SECTIONS:
        assert DEFAULTS[section]["host"] == "127.0.0.1"
        assert DEFAULTS[section]["max_message_bytes"] == 4194304
        assert DEFAULTS[section]["log_format"] == "kv"


def test_sample_lists_every_key_with_its_default() -> None:
    assert json.loads(SAMPLE.read_text()) == DEFAULTS


def test_sample_passes_config_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_cmd.main(["check", str(SAMPLE)]) == 0
    assert capsys.readouterr().out == "OK\n"


def test_no_file_gives_defaults_and_a_private_copy() -> None:
    config = load_config(env={})
    assert config == DEFAULTS
    config["nodemanager"]["ports"].append(1)
    config["engine"]["env"]["X"] = "y"
    assert load_config(env={}) == DEFAULTS


# --- file shapes ----------------------------------------------------------------------------------


def test_sectioned_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"port": 7101}, "engine": {"env": {"A": "1"}}})
    config = load_config(path, env={})
    assert config["controller"]["port"] == 7101
    assert config["engine"]["env"] == {"A": "1"}
    assert config["coordinator"] == DEFAULTS["coordinator"]
    # The section argument does not matter for a sectioned file.
    assert load_config(path, section="nodemanager", env={}) == config


def test_empty_object_is_sectioned(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, {}), env={}) == DEFAULTS


def test_flat_file_goes_to_the_given_section(tmp_path: Path) -> None:
    path = write(tmp_path, {"port": 7301, "role": "decode", "parallel": {"tp": 2}})
    config = load_config(path, section="nodemanager", env={})
    assert config["nodemanager"]["port"] == 7301
    assert config["nodemanager"]["role"] == "decode"
    assert config["nodemanager"]["parallel"] == {"dp": 1, "tp": 2, "pp": 1, "ep": 1, "nnodes": 1}
    assert config["controller"] == DEFAULTS["controller"]


def test_flat_file_without_section(tmp_path: Path) -> None:
    path = write(tmp_path, {"port": 1})
    assert errors_of(path) == [f"{path}: flat config needs --section"]


def test_flat_file_holding_only_a_controller_address(tmp_path: Path) -> None:
    # Every top-level key is a section name, but "controller" is also a coordinator key.
    path = write(tmp_path, {"controller": "10.0.0.1:7100"})
    config = load_config(path, section="coordinator", env={})
    assert config["coordinator"]["controller"] == "10.0.0.1:7100"
    assert errors_of(path) == [f'{path}: controller: expected object, got string "10.0.0.1:7100"']


def test_flat_keys_of_another_section_are_unknown(tmp_path: Path) -> None:
    path = write(tmp_path, {"http_port": 8001})
    assert errors_of(path, section="controller") == [
        f"{path}: controller.http_port: unknown key; did you mean 'port'?"
    ]


def test_section_value_must_be_an_object(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": [1], "engine": {}})
    assert errors_of(path) == [f"{path}: controller: expected object, got array"]


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "controller": {\n    "port": 7100,\n  }\n}\n')
    assert errors_of(path) == [f"{path}:4:3: invalid JSON: Expecting property name enclosed in double quotes"]


def test_empty_file_is_invalid_json(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    assert errors_of(path) == [f"{path}:1:1: invalid JSON: Expecting value"]


@pytest.mark.parametrize(("content", "kind"), [("[]", "array"), ("3", "integer"), ('"x"', "string")])
def test_top_level_must_be_an_object(tmp_path: Path, content: str, kind: str) -> None:
    path = write(tmp_path, content)
    assert errors_of(path) == [f"{path}: expected a JSON object at the top level, got {kind}"]


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.json")
    assert errors_of(missing) == [f"{missing}: cannot read: No such file or directory"]
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"{\xff}")
    assert errors_of(str(binary)) == [f"{binary}: not UTF-8 text"]


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"controller": {"port": 1}}).encode())
    assert load_config(str(path), env={})["controller"]["port"] == 1


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    path = write(tmp_path, '{"controller": {"port": 1, "port": 2}}')
    assert errors_of(path) == [f'{path}: duplicate key "port"']


def test_absurd_json_is_a_config_error(tmp_path: Path) -> None:
    deep = write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep.json")
    assert errors_of(deep) == [f"{deep}: invalid JSON: nested too deeply"]
    huge = write(tmp_path, '{"controller": {"port": ' + "9" * 5000 + "}}", "huge.json")
    (error,) = errors_of(huge)
    assert error.startswith(f"{huge}: invalid JSON: ")


# --- keys, types and ranges -------------------------------------------------------------------


def test_unknown_key_names_the_nearest(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"portt": 1}, "nodemanager": {"paralel": {}, "zzz": 1}})
    assert errors_of(path) == [
        f"{path}: controller.portt: unknown key; did you mean 'port'?",
        f"{path}: nodemanager.paralel: unknown key; did you mean 'parallel'?",
        # Always a suggestion, however far off.
        f"{path}: nodemanager.zzz: unknown key; did you mean '{nearest('zzz', 'nodemanager')}'?",
    ]


def test_unknown_key_with_control_characters_stays_on_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"po\nrt": 1, "x" * 500: 2}})
    errors = errors_of(path)
    assert errors[0] == f"{path}: controller.\"po\\nrt\": unknown key; did you mean 'port'?"
    assert len(errors) == 2 and all("\n" not in e and len(e) < 200 + len(path) for e in errors)


BAD_VALUES = [
    # (section, key, value, message)
    ("controller", "port", "x", 'expected integer, got string "x"'),
    ("controller", "port", 70000, "must be between 0 and 65535, got 70000"),
    ("controller", "port", -1, "must be between 0 and 65535, got -1"),
    ("controller", "port", True, "expected integer, got boolean true"),
    ("controller", "port", 7100.0, "expected integer, got number 7100.0"),
    ("controller", "port", None, "expected integer, got null"),
    ("controller", "coordinators", "127.0.0.1:7200", 'expected array, got string "127.0.0.1:7200"'),
    ("controller", "coordinators", ["h:1", "nohost"], None),
    ("controller", "coordinators", ["h:1", "h:1"], 'must not contain duplicates, got ["h:1", "h:1"]'),
    ("controller", "state_dir", "", 'expected a non-empty path without NUL, got ""'),
    ("controller", "tls_cert_file", "a\0b", 'expected a path without NUL, got "a\\u0000b"'),
    ("controller", "heartbeat_interval_s", 0, "must be greater than 0 and at most 604800, got 0"),
    ("controller", "heartbeat_interval_s", "3", 'expected number of seconds, got string "3"'),
    (
        "controller",
        "instance_heartbeat_timeout_s",
        -1.5,
        "must be greater than 0 and at most 604800, got -1.5",
    ),
    (
        "controller",
        "instance_assemble_timeout_s",
        10**9,
        "must be greater than 0 and at most 604800, got 1000000000",
    ),
    ("controller", "start_command_retries", -1, "must be between 0 and 100, got -1"),
    ("controller", "enable_engine_relaunch", 1, "expected boolean, got integer 1"),
    ("controller", "enable_engine_relaunch", "true", 'expected boolean, got string "true"'),
    ("controller", "engine_relaunch_complete_timeout_s", 59, "must be at least 60 and at most 3600, got 59"),
    (
        "controller",
        "engine_relaunch_complete_timeout_s",
        3601,
        "must be at least 60 and at most 3600, got 3601",
    ),
    ("controller", "engine_relaunch_poll_interval_s", 0.5, "must be at least 1 and at most 60, got 0.5"),
    ("controller", "engine_relaunch_poll_interval_s", 61, "must be at least 1 and at most 60, got 61"),
    ("controller", "engine_relaunch_dispatch_retries", 11, "must be between 0 and 10, got 11"),
    ("controller", "engine_relaunch_nm_unreachable_threshold", 0, "must be between 1 and 10, got 0"),
    ("controller", "engine_relaunch_nm_unreachable_threshold", 11, "must be between 1 and 10, got 11"),
    ("controller", "alarm_webhook_url", "ftp://x", None),
    ("controller", "coordinator_key_file", 5, "expected string, got integer 5"),
    ("coordinator", "http_port", 65536, "must be between 0 and 65535, got 65536"),
    ("coordinator", "workers", 257, "must be between 0 and 256, got 257"),
    ("coordinator", "max_json_depth", 0, "must be between 1 and 512, got 0"),
    ("coordinator", "max_body_bytes", 10, "must be between 1024 and 2147483648, got 10"),
    ("coordinator", "prefill_policy", "random", None),
    ("coordinator", "decode_policy", "LEAST_LOAD", None),
    ("coordinator", "kv_prefix_weight", -1, "expected a number from 0 to 1000000, got -1"),
    ("coordinator", "kv_load_weight", True, "expected a number from 0 to 1000000, got true"),
    ("coordinator", "kv_index_max_blocks", 0, "must be between 1 and 1073741824, got 0"),
    ("coordinator", "tokenizers", {"m": 3}, None),
    ("coordinator", "tokenizers", {"": "/x"}, None),
    ("coordinator", "tokenizers", ["/x"], "expected object, got array"),
    ("coordinator", "controller", "127.0.0.1", None),
    ("coordinator", "controller", "127.0.0.1:0", None),
    ("coordinator", "controller", "h:99999", None),
    ("coordinator", "controller", "h :1", None),
    ("coordinator", "precision_logprobs", 0, "must be between 1 and 20, got 0"),
    ("coordinator", "precision_issue_threshold", 0, "must be between 1 and 1000000, got 0"),
    ("coordinator", "precision_probe_question", "", None),
    ("coordinator", "probe_timeout_s", float("nan"), "must be greater than 0 and at most 604800, got NaN"),
    ("nodemanager", "role", "both", "must be one of 'prefill', 'decode', 'union', got \"both\""),
    ("nodemanager", "engine_type", "trt", "must be one of 'vllm', 'sglang', 'sim', got \"trt\""),
    ("nodemanager", "sim_protocol", "sim", "must be one of 'vllm', 'sglang', got \"sim\""),
    ("nodemanager", "model", "", None),
    ("nodemanager", "ports", [], "must not be empty"),
    ("nodemanager", "ports", 10000, "expected array, got integer 10000"),
    ("nodemanager", "ports", [10000, 65535], None),
    ("nodemanager", "ports", [10000, 0], None),
    ("nodemanager", "device_count", -1, "must be between 0 and 4096, got -1"),
    ("nodemanager", "device_env", "NOT VALID", None),
    ("nodemanager", "cpu_cores", "3-1", 'core range "3-1" must run upwards from 0 to 65535'),
    ("nodemanager", "cpu_cores", "0-3,x", 'expected a cpuset such as "0-3,6", got "0-3,x"'),
    ("nodemanager", "cpu_cores", "0-3,2", "must name each core once, got 2 again"),
    ("nodemanager", "cpu_cores", [1, 1], "must name each core once, got 1 again"),
    ("nodemanager", "cpu_cores", -1, "must be between 0 and 65535, got -1"),
    ("nodemanager", "cpu_cores", True, None),
    ("nodemanager", "cpu_cores", {"0": 1}, None),
    ("nodemanager", "node_rank", -1, "must be between 0 and 1000000, got -1"),
    ("nodemanager", "parallel", [1], "expected object, got array"),
    ("nodemanager", "suicide_threshold", 0, "must be between 1 and 1000000, got 0"),
    ("nodemanager", "engine_stop_grace_s", -1, "must be at least 0 and at most 604800, got -1"),
    ("engine", "args", [], "expected object, got array"),
    ("engine", "env", {"A": 1}, None),
    ("engine", "env", {"A=B": "1"}, None),
    ("engine", "env", "A=1", 'expected object, got string "A=1"'),
    ("engine", "kv_connector", "", None),
    ("engine", "kv_transfer_config", [], "expected object, got array"),
    ("engine", "kv_transfer_config", {"kv_role": "kv_both"}, None),
    ("engine", "kv_transfer_config", {"kv_connector": ""}, None),
    ("engine", "kv_transfer_config", {"": 1}, None),
    ("engine", "cpu_kvcache_space_gib", -1, "must be between 0 and 1048576, got -1"),
    ("engine", "cpu_kvcache_space_gib", 1.5, "expected integer, got number 1.5"),
    ("controller", "max_message_bytes", 1023, "must be between 1024 and 2147483647, got 1023"),
    ("coordinator", "log_format", "text", "must be one of 'kv', 'json', got \"text\""),
    ("nodemanager", "host", "", None),
    ("engine", "host", "a b", None),
]


@pytest.mark.parametrize(("section", "key", "value", "message"), BAD_VALUES)
def test_bad_values(tmp_path: Path, section: str, key: str, value: Any, message: str | None) -> None:
    path = write(tmp_path, {section: {key: value}})
    (error,) = errors_of(path)
    prefix = f"{path}: {section}.{key}"
    assert error.startswith(prefix)
    if message is not None:
        assert error == f"{prefix}: {message}"


def test_bad_elements_are_located(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "controller": {"coordinators": ["h:1", "nohost"]},
            "nodemanager": {"ports": [10000, "x"], "parallel": {"tp": 0, "xp": 2}},
            "engine": {"env": {"HF_TOKEN": 123}},
        },
    )
    assert errors_of(path) == [
        f'{path}: controller.coordinators[1]: expected host:port with a port from 1 to 65535, got "nohost"',
        f'{path}: nodemanager.ports[1]: expected integer, got string "x"',
        f"{path}: nodemanager.parallel.tp: must be between 1 and 1000000, got 0",
        f"{path}: nodemanager.parallel.xp: unknown key; did you mean 'tp'?",
        # Engine environment values may be secrets: never echoed.
        f"{path}: engine.env.HF_TOKEN: expected string without NUL, got integer",
    ]


GOOD_VALUES = [
    ("controller", "port", 0),
    ("controller", "port", 65535),
    ("controller", "coordinators", []),
    ("controller", "coordinators", ["[::1]:7200", "coord-0.svc:7200"]),
    ("controller", "heartbeat_interval_s", 0.25),
    ("controller", "engine_relaunch_complete_timeout_s", 60),
    ("controller", "engine_relaunch_complete_timeout_s", 3600),
    ("controller", "engine_relaunch_poll_interval_s", 1),
    ("controller", "engine_relaunch_poll_interval_s", 60.0),
    ("controller", "engine_relaunch_dispatch_retries", 0),
    ("controller", "engine_relaunch_dispatch_retries", 10),
    ("controller", "engine_relaunch_nm_unreachable_threshold", 1),
    ("controller", "alarm_webhook_url", "https://hooks.example/x"),
    ("coordinator", "prefill_policy", "power_of_two"),
    ("coordinator", "decode_policy", "round_robin"),
    ("coordinator", "prefill_policy", "kv_aware"),
    ("coordinator", "kv_load_weight", 0),
    ("coordinator", "tokenizers", {"llama": "/models/llama"}),
    ("coordinator", "controller", "localhost:1"),
    ("coordinator", "log_format", "json"),
    ("nodemanager", "role", "union"),
    ("nodemanager", "engine_type", "vllm"),
    ("nodemanager", "ports", [10000, 10002]),
    ("nodemanager", "host", "::"),
    ("nodemanager", "engine_stop_grace_s", 0),
    ("engine", "args", {"max-model-len": 4096, "enforce-eager": True, "compilation-config": {"level": 3}}),
    ("engine", "env", {"HF_HUB_OFFLINE": "1"}),
    ("nodemanager", "device_env", "cpu"),
    ("nodemanager", "cpu_cores", [4, 5, 0]),
    ("nodemanager", "cpu_cores", []),
    ("engine", "kv_transfer_config", {"kv_buffer_device": "cpu", "kv_port": 14579}),
    (
        "engine",
        "kv_transfer_config",
        {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [{"kv_connector": "NixlConnector"}]},
        },
    ),
    ("engine", "cpu_kvcache_space_gib", 40),
]


@pytest.mark.parametrize(("section", "key", "value"), GOOD_VALUES)
def test_good_values(tmp_path: Path, section: str, key: str, value: Any) -> None:
    path = write(tmp_path, {section: {key: value}})
    assert load_config(path, env={})[section][key] == value


def test_cpu_cores_are_stored_as_a_list_in_the_order_given(tmp_path: Path) -> None:
    def cores(value: Any) -> Any:
        return load_config(write(tmp_path, {"nodemanager": {"cpu_cores": value}}), env={})["nodemanager"][
            "cpu_cores"
        ]

    assert cores("0-3,6") == [0, 1, 2, 3, 6]
    assert cores(" 8-9, 0 ") == [8, 9, 0]
    assert cores("") == []
    assert cores(3) == [3]
    # The widest cpuset there is loads at once (its repeats are counted in one pass).
    assert cores("0-65535") == list(range(65536))
    # From the environment: a cpuset, a lone core, or a JSON array (what `motor up` writes).
    for raw, expected in (("0-3", [0, 1, 2, 3]), ("3", [3]), ("[2, 0]", [2, 0]), ("0,2", [0, 2])):
        env = {"MOTOR_NODEMANAGER_CPU_CORES": raw}
        assert load_config(env=env)["nodemanager"]["cpu_cores"] == expected, raw


def test_kv_transfer_config_refuses_motors_own_fields(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"engine": {"kv_transfer_config": {"kv_buffer_device": "cpu", "kv_role": "kv_both"}}},
    )
    assert errors_of(path) == [
        f"{path}: engine.kv_transfer_config.kv_role: set by Motor from the node's role "
        "(kv_producer for prefill, kv_consumer for decode); remove it"
    ]
    path = write(tmp_path, {"engine": {"kv_transfer_config": {"engine_id": "x"}}})
    assert errors_of(path) == [
        f"{path}: engine.kv_transfer_config.engine_id: set by Motor to the instance id "
        "(the same on every engine of an instance); remove it"
    ]
    path = write(tmp_path, {"engine": {"kv_transfer_config": {"kv_connector": 3}}})
    assert errors_of(path) == [
        f"{path}: engine.kv_transfer_config.kv_connector: expected a non-empty string, got integer 3"
    ]


def test_parallel_fills_missing_sizes(tmp_path: Path) -> None:
    path = write(tmp_path, {"nodemanager": {"parallel": {"dp": 2, "nnodes": 2, "pp": 2}}})
    parallel = load_config(path, env={})["nodemanager"]["parallel"]
    assert parallel == {"dp": 2, "tp": 1, "pp": 2, "ep": 1, "nnodes": 2}


def test_a_rank_spanning_nodes_must_split_evenly(tmp_path: Path) -> None:
    path = write(tmp_path, {"nodemanager": {"parallel": {"nnodes": 2, "tp": 3}}})
    assert errors_of(path) == [
        f"{path}: nodemanager.parallel.nnodes: must divide tp * pp (3 * 1): "
        "each node runs an equal share of a rank's workers"
    ]


def test_the_etcd_store_needs_endpoints(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"store": "etcd"}})
    missing = '"etcd" needs controller.etcd_endpoints (at least one "host:port")'
    assert errors_of(path) == [f"{path}: controller.store: {missing}"]
    assert errors_of(env={"MOTOR_CONTROLLER_STORE": "etcd"}) == [f"env MOTOR_CONTROLLER_STORE: {missing}"]
    # A refused address list is reported once, as refused.
    [refused] = errors_of(path, overrides={"controller": {"etcd_endpoints": ["nope"]}})
    assert refused.startswith("command line: controller.etcd_endpoints[0]: ")
    given = load_config(path, env={"MOTOR_CONTROLLER_ETCD_ENDPOINTS": '["127.0.0.1:2379"]'})
    assert given["controller"]["etcd_endpoints"] == ["127.0.0.1:2379"]


def test_a_hang_timeout_the_pod_restart_fallback_would_beat_is_refused(tmp_path: Path) -> None:
    """The fallback may act suicide_check_interval_s * (suicide_threshold - 1) after an engine
    turned ABNORMAL (its first check can come right then): a hung engine must be killed, and so
    relaunched in place, before that."""
    defaults = load_config(env={})["nodemanager"]
    assert defaults["engine_hang_timeout_s"] == 9
    assert (defaults["suicide_check_interval_s"], defaults["suicide_threshold"]) == (3, 5)
    assert (defaults["engine_probe_inference"], defaults["probe_inference_interval_s"]) == (False, 5)
    assert defaults["probe_inference_failures"] == 6

    path = write(tmp_path, {"nodemanager": {"engine_hang_timeout_s": 12}})
    assert errors_of(path) == [
        f"{path}: nodemanager.engine_hang_timeout_s: engine_hang_timeout_s 12 is not shorter than "
        "suicide_check_interval_s 3 * (suicide_threshold 5 - 1) = 12 s: the pod-restart fallback "
        "could end the node before a hung engine is killed and relaunched in place; lower "
        "engine_hang_timeout_s or raise suicide_check_interval_s or suicide_threshold"
    ]
    # Said where the operator set a value, whichever of the three it was.
    [line] = errors_of(env={"MOTOR_NODEMANAGER_SUICIDE_THRESHOLD": "3"})
    assert line.startswith("env MOTOR_NODEMANAGER_SUICIDE_THRESHOLD: engine_hang_timeout_s 9 ")
    assert "suicide_check_interval_s 3 * (suicide_threshold 3 - 1) = 6 s" in line
    [line] = errors_of(overrides={"nodemanager": {"suicide_check_interval_s": 0.5}})
    assert line.startswith("command line: nodemanager.suicide_check_interval_s: ")
    # Either way out is accepted.
    assert (
        load_config(path, env={"MOTOR_NODEMANAGER_SUICIDE_THRESHOLD": "6"})["nodemanager"][
            "engine_hang_timeout_s"
        ]
        == 12
    )
    fast = {"engine_hang_timeout_s": 2, "suicide_check_interval_s": 1, "suicide_threshold": 5}
    assert load_config(overrides={"nodemanager": fast}, env={})["nodemanager"]["suicide_threshold"] == 5
    # A refused value is reported as refused, not again here.
    [refused] = errors_of(overrides={"nodemanager": {"engine_hang_timeout_s": 12, "suicide_threshold": 0}})
    assert refused.startswith("command line: nodemanager.suicide_threshold: must be between 1 and")


def test_an_etcd_controller_on_a_wildcard_host_needs_an_advertise_address(tmp_path: Path) -> None:
    """Standbys name the leader by its address: 0.0.0.0 would send every client nowhere."""
    cfg = {"store": "etcd", "etcd_endpoints": ["127.0.0.1:2379"], "host": "0.0.0.0"}
    path = write(tmp_path, {"controller": cfg})
    [line] = errors_of(path)
    assert line.startswith(f"{path}: controller.store: ") and "controller.advertise_address" in line
    given = load_config(path, env={"MOTOR_CONTROLLER_ADVERTISE_ADDRESS": "10.0.0.7:7100"})
    assert given["controller"]["advertise_address"] == "10.0.0.7:7100"
    sqlite = load_config(write(tmp_path, {"controller": {**cfg, "store": "sqlite"}}), env={})
    assert sqlite["controller"]["host"] == "0.0.0.0"


# --- environment and flags ---------------------------------------------------------------------


def test_env_values_parse_as_json_else_string() -> None:
    config = load_config(
        env={
            "MOTOR_CONTROLLER_PORT": "7101",
            "MOTOR_CONTROLLER_HEARTBEAT_INTERVAL_S": "0.5",
            "MOTOR_CONTROLLER_ENABLE_ENGINE_RELAUNCH": "false",
            "MOTOR_CONTROLLER_COORDINATORS": '["10.0.0.1:7200", "10.0.0.2:7200"]',
            "MOTOR_NODEMANAGER_PARALLEL": '{"tp": 4}',
            "MOTOR_NODEMANAGER_MODEL": "Qwen/Qwen3-8B",  # not JSON: taken as a string
            "MOTOR_NODEMANAGER_JOB_NAME": "2024",  # JSON number, but a text key takes it verbatim
            "MOTOR_NODEMANAGER_SERVED_MODEL_NAME": '"quoted"',  # a JSON string literal is decoded
            "MOTOR_ENGINE_ENV": '{"A": "b"}',
        }
    )
    assert config["controller"]["port"] == 7101
    assert config["controller"]["heartbeat_interval_s"] == 0.5
    assert config["controller"]["enable_engine_relaunch"] is False
    assert config["controller"]["coordinators"] == ["10.0.0.1:7200", "10.0.0.2:7200"]
    assert config["nodemanager"]["parallel"]["tp"] == 4
    assert config["nodemanager"]["model"] == "Qwen/Qwen3-8B"
    assert config["nodemanager"]["job_name"] == "2024"
    assert config["nodemanager"]["served_model_name"] == "quoted"
    assert config["engine"]["env"] == {"A": "b"}


def test_env_values_are_checked() -> None:
    assert errors_of(env={"MOTOR_CONTROLLER_PORT": "x", "MOTOR_COORDINATOR_WORKERS": "-1"}) == [
        'env MOTOR_CONTROLLER_PORT: expected integer, got string "x"',
        "env MOTOR_COORDINATOR_WORKERS: must be between 0 and 256, got -1",
    ]


def test_unknown_motor_env_var_is_an_error() -> None:
    assert errors_of(env={"MOTOR_CONTROLLER_PORTT": "1", "MOTOR_ENGINE_KV_CONECTOR": "x"}) == [
        "env MOTOR_CONTROLLER_PORTT: unknown key; did you mean 'MOTOR_CONTROLLER_PORT'?",
        "env MOTOR_ENGINE_KV_CONECTOR: unknown key; did you mean 'MOTOR_ENGINE_KV_CONNECTOR'?",
    ]
    # The key part is upper-case, exactly.
    assert errors_of(env={"MOTOR_CONTROLLER_port": "1"}) == [
        "env MOTOR_CONTROLLER_port: unknown key; did you mean 'MOTOR_CONTROLLER_PORT'?"
    ]


def test_other_env_vars_are_ignored() -> None:
    env = {
        "MOTOR_FOO": "1",
        "MOTOR_FOO_PORT": "x",
        "PATH": "/bin",
        "motor_controller_port": "x",
        "MOTOR_": "",
    }
    assert load_config(env=env) == DEFAULTS


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOTOR_COORDINATOR_HTTP_PORT", "8001")
    assert load_config()["coordinator"]["http_port"] == 8001
    assert load_config(env={})["coordinator"]["http_port"] == 8000


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"port": 1, "heartbeat_interval_s": 1, "state_dir": "f"}})
    env = {"MOTOR_CONTROLLER_PORT": "2", "MOTOR_CONTROLLER_HEARTBEAT_INTERVAL_S": "2"}
    config = load_config(path, env=env, overrides={"controller": {"port": 3}})
    controller = config["controller"]
    assert controller["port"] == 3  # flag
    assert controller["heartbeat_interval_s"] == 2  # env
    assert controller["state_dir"] == "f"  # file
    assert controller["instance_heartbeat_timeout_s"] == 10  # default


def test_objects_are_replaced_not_merged(tmp_path: Path) -> None:
    path = write(tmp_path, {"nodemanager": {"parallel": {"dp": 2, "tp": 2}}})
    parallel = load_config(path, env={"MOTOR_NODEMANAGER_PARALLEL": '{"tp": 4}'})["nodemanager"]["parallel"]
    assert parallel == {"dp": 1, "tp": 4, "pp": 1, "ep": 1, "nnodes": 1}


def test_overrides_skip_none_and_are_checked() -> None:
    config = load_config(env={}, overrides={"controller": {"port": None, "state_dir": "s"}})
    assert config["controller"]["port"] == 7100
    assert config["controller"]["state_dir"] == "s"
    assert errors_of(overrides={"controller": {"port": "x", "prot": 1}, "router": {"port": 1}}) == [
        'command line: controller.port: expected integer, got string "x"',
        "command line: controller.prot: unknown key; did you mean 'port'?",
        'command line: unknown section "router"',
    ]


def test_overrides_are_copied() -> None:
    ports = [10000]
    config = load_config(env={}, overrides={"nodemanager": {"ports": ports}})
    config["nodemanager"]["ports"].append(10002)
    assert ports == [10000]


def test_unknown_section_argument() -> None:
    assert errors_of(section="controler") == ["unknown section \"controler\"; did you mean 'controller'?"]


def test_all_errors_are_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"portt": 1, "workers": 2}, "coordinator": {"workers": 300}})
    errors = errors_of(
        path,
        env={"MOTOR_NODEMANAGER_ROLE": "both", "MOTOR_ENGINE_ARG": "{}"},
        overrides={"coordinator": {"http_port": -1}},
    )
    assert errors == [
        f"{path}: controller.portt: unknown key; did you mean 'port'?",
        f"{path}: controller.workers: unknown key; did you mean '{nearest('workers', 'controller')}'?",
        f"{path}: coordinator.workers: must be between 0 and 256, got 300",
        "env MOTOR_ENGINE_ARG: unknown key; did you mean 'MOTOR_ENGINE_ARGS'?",
        "env MOTOR_NODEMANAGER_ROLE: must be one of 'prefill', 'decode', 'union', got \"both\"",
        "command line: coordinator.http_port: must be between 0 and 65535, got -1",
    ]


# --- management key file -----------------------------------------------------------------------


def key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "key"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_key_file_private_is_read_without_trailing_newline(tmp_path: Path, mode: int) -> None:
    assert read_key_file(key_file(tmp_path, b"s3cret-key\n", mode)) == "s3cret-key"
    assert read_key_file(key_file(tmp_path, b" spaced key\r\n")) == " spaced key"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, b"s3cret-key\n", mode)
    with pytest.raises(ConfigError) as info:
        read_key_file(path)
    assert info.value.errors == [f"{path}: key file must not be readable by group or others (chmod 600)"]
    assert "s3cret" not in str(info.value)


def test_key_file_symlink_is_judged_by_its_target(tmp_path: Path) -> None:
    target = key_file(tmp_path, b"k\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_key_file(str(link)) == "k"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "key file is empty"),
        (b"\n\n", "key file is empty"),
        (b"caf\xc3\xa9\n", "key file must hold printable ASCII only"),
        (b"a\nb\n", "key file must hold printable ASCII only"),
        (b"k" * 5000, "key file is larger than 4096 bytes"),
    ],
)
def test_bad_key_file_content(tmp_path: Path, content: bytes, message: str) -> None:
    path = key_file(tmp_path, content)
    with pytest.raises(ConfigError) as info:
        read_key_file(path)
    assert info.value.errors == [f"{path}: {message}"]


def test_missing_key_file_and_directory(tmp_path: Path) -> None:
    missing = str(tmp_path / "none")
    with pytest.raises(ConfigError, match="cannot read key file: No such file or directory"):
        read_key_file(missing)
    with pytest.raises(ConfigError, match="key file is not a regular file"):
        read_key_file(str(tmp_path))


# --- motor config check ------------------------------------------------------------------------


def run_motor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOTOR_")}
    return subprocess.run(
        [sys.executable, "-m", "motor_mesh.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_check_reports_every_mistake(tmp_path: Path) -> None:
    path = write(tmp_path, {"controller": {"portt": 7100}, "coordinator": {"decode_polcy": "least_load"}})
    result = run_motor("config", "check", path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{path}: controller.portt: unknown key; did you mean 'port'?",
        f"{path}: coordinator.decode_polcy: unknown key; did you mean 'decode_policy'?",
    ]


def test_config_check_names_a_kv_transfer_field_motor_sets(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"engine": {"kv_transfer_config": {"kv_connector_extra_config": {"a": 1}, "engine_id": "e"}}},
    )
    result = run_motor("config", "check", path)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [
        f"{path}: engine.kv_transfer_config.engine_id: set by Motor to the instance id "
        "(the same on every engine of an instance); remove it"
    ]


def test_config_check_ok_and_flat_file(tmp_path: Path) -> None:
    result = run_motor("config", "check", str(SAMPLE))
    assert (result.returncode, result.stdout, result.stderr) == (0, "OK\n", "")
    flat = write(tmp_path, {"port": 7301, "role": "union"})
    result = run_motor("config", "check", flat, "--section", "nodemanager")
    assert (result.returncode, result.stdout) == (0, "OK\n")
    result = run_motor("config", "check", flat)
    assert (result.returncode, result.stderr) == (1, f"{flat}: flat config needs --section\n")


def test_config_check_ignores_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MOTOR_CONTROLLER_PORTT", "1")
    assert config_cmd.main(["check", write(tmp_path, {})]) == 0
    assert capsys.readouterr().out == "OK\n"


def test_config_check_invalid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '{"controller": {\n  "port": 7100\n  "host": "x"}}')
    assert config_cmd.main(["check", path]) == 1
    assert capsys.readouterr().err == f"{path}:3:3: invalid JSON: Expecting ',' delimiter\n"


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        ([], 2),
        (["check"], 2),
        (["lint", "x"], 2),
        (["check", "f", "--section", "router"], 2),
        (["--help"], 0),
    ],
)
def test_config_usage(argv: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert config_cmd.main(argv) == code
    captured = capsys.readouterr()
    assert "usage: motor config" in (captured.out if code == 0 else captured.err)


def test_config_check_help_via_motor() -> None:
    result = run_motor("config", "check", "--help")
    assert result.returncode == 0
    assert "--section" in result.stdout


# --- fuzzing -----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
KEYS = [(section, key) for section in SECTIONS for key in DEFAULTS[section]]


def _only_config_errors(*args: Any, **kwargs: Any) -> None:
    try:
        load_config(*args, **kwargs)
    except ConfigError as exc:
        assert exc.errors
        assert all(isinstance(e, str) and e and "\n" not in e for e in exc.errors)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(KEYS), json_values, st.sampled_from([None, *SECTIONS]))
def test_any_json_value_for_any_key_is_only_ever_a_config_error(
    key: tuple[str, str], value: Any, flat_section: str | None
) -> None:
    section, name = key
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cfg.json")
        content = {name: value} if flat_section else {section: {name: value}}
        with open(path, "w") as f:
            json.dump(content, f)
        _only_config_errors(path, section=flat_section or section, env={})
    _only_config_errors(env={f"MOTOR_{section.upper()}_{name.upper()}": json.dumps(value)})
    _only_config_errors(overrides={section: {name: value}}, env={})


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=30), json_values, max_size=5), st.sampled_from([None, *SECTIONS]))
def test_any_json_document_is_only_ever_a_config_error(document: dict[str, Any], section: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cfg.json")
        with open(path, "w") as f:
            json.dump(document, f)
        _only_config_errors(path, section=section, env={})


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_only_ever_a_config_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cfg.json")
        with open(path, "wb") as f:
            f.write(content)
        _only_config_errors(path, section="controller", env={})


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=30).map(lambda s: "MOTOR_" + s), st.text(max_size=30), max_size=5))
def test_any_motor_environment_is_only_ever_a_config_error(env: dict[str, str]) -> None:
    _only_config_errors(env=env)
