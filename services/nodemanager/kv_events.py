"""The ``--kv-events-config`` an engine is given, and the ports an operator's own one binds.

vLLM, SGLang and the simulated engine take the same JSON; each binds the endpoint and replay
endpoint ports plus its DP rank (vLLM's ``offset_endpoint_port``). Which ports an endpoint gets
is :func:`motor_mesh.nodemanager.launch.kv_events_ports`.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Where vLLM and SGLang publish when a kv_events_config enables events but names no endpoint.
DEFAULT_ENDPOINT = "tcp://*:5557"
_TCP_ENDPOINT = re.compile(r"tcp://[^/]+:(?P<port>\d+)")


def config(pub: int, replay: int, rank: int) -> str:
    """Our ``--kv-events-config``: the rank is subtracted, so an engine that adds its DP rank
    binds exactly ``pub`` and ``replay``."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub - rank}",
            "replay_endpoint": f"tcp://*:{replay - rank}",
            "topic": "",
        },
        separators=(",", ":"),
    )


def operator_ports(value: Any, rank: int) -> tuple[int, int]:
    """(PUB port, replay port) an operator's own kv_events_config (an object, or its JSON
    text) binds on an engine of DP rank ``rank``; 0 where it publishes nothing we can follow:
    events off, another publisher, or an endpoint that is not ``tcp://<host>:<port>``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return 0, 0
    if not isinstance(value, dict) or not value.get("enable_kv_cache_events"):
        return 0, 0
    if value.get("publisher", "zmq") != "zmq":
        return 0, 0
    pub = _tcp_port(value.get("endpoint", DEFAULT_ENDPOINT), rank)
    replay = _tcp_port(value.get("replay_endpoint"), rank) if pub else 0
    return pub, replay


def _tcp_port(endpoint: Any, rank: int) -> int:
    match = _TCP_ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    port = int(match["port"]) + rank if match else 0
    return port if 0 < port <= 65535 else 0
