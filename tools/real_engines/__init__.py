"""Real engines on this machine's CPU: where `make real-engines` puts them (install.py), whether
they are there, and the configuration a `motor up` cluster serves the tiny model with. Shared by
the real-engine tests (tests/real) and benchmarks (bench/loadgen/real_failover.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINES = REPO / ".engines"
VLLM_BIN = ENGINES / "vllm" / "bin"
TINY_MODEL = ENGINES / "tiny-llama3"

# - the engines serve the tiny model in eager mode (no graph capture: seconds, not minutes, to
#   start) with a small KV cache (1 GiB holds two million of its tokens);
# - NIXL moves KV through host memory (kv_buffer_device cpu, what a CPU engine has);
# - UCX, NIXL's transport, uses only the loopback device: nothing leaves 127.0.0.0/8;
# - nothing is ever fetched from a model hub;
# - a real engine takes tens of seconds to load, and a relaunch waits for it.
CLUSTER_CONFIG: dict[str, Any] = {
    "engine": {
        "args": {"enforce_eager": True, "dtype": "bfloat16", "max_model_len": 2048},
        "env": {"HF_HUB_OFFLINE": "1", "UCX_NET_DEVICES": "lo"},
        "kv_transfer_config": {"kv_buffer_device": "cpu"},
        "cpu_kvcache_space_gib": 1,
    },
    "nodemanager": {"engine_startup_timeout_s": 600},
}


def cluster_config(**coordinator: Any) -> dict[str, Any]:
    """CLUSTER_CONFIG with these coordinator keys."""
    return {**copy.deepcopy(CLUSTER_CONFIG), "coordinator": coordinator}


def unavailable() -> str:
    """Why real engines cannot run here, in one line; "" when they can."""
    note = ENGINES / "unavailable"
    if note.is_file():
        return f"real engines unavailable: {note.read_text().strip()}"
    if not (ENGINES / "vllm" / ".installed").is_file() or not (TINY_MODEL / ".made").is_file():
        return "real engines not installed: run `make real-engines` (or `make test-real`)"
    return ""
