"""Real vLLM engines for `make test-real`: where they are, why they may be missing, and a
`motor up` cluster running them.

`make real-engines` installs vLLM for this machine's CPU into ``.engines/vllm`` and writes a tiny
model with the real Llama 3 tokenizer and chat template to ``.engines/tiny-llama3``
(tools/real_engines/, which also holds the cluster configuration). Where that could not be done,
the tests skip with the one line saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from motor_mesh.cli.up_plan import UCX_PORTS_BASE, UCX_PORTS_PER_WORKER
from motor_mesh.nodemanager.launch import SIDE_CHANNEL_OFFSET
from tests.e2e.cluster import ENGINE, NM, Cluster
from tests.poll import wait_until
from tools.real_engines import TINY_MODEL, VLLM_BIN, cluster_config


class RealCluster(Cluster):
    """``motor up --engine-type vllm --model <the tiny model's absolute path>`` with ``prefill``
    prefill, ``decode`` decode and ``union`` union NodeManagers of one engine each (engines are
    numbered in that order), vLLM on PATH."""

    def __init__(self, tmp: Path, prefill: int, decode: int, union: int = 0, **coordinator: Any) -> None:
        cfg = tmp / "motor.json"
        cfg.write_text(json.dumps(cluster_config(**coordinator)))
        engines = prefill + decode + union
        # Besides what `motor up`'s tests always keep free: each engine's NIXL side channel and
        # the window its UCX listeners take ports from (tp = pp = 1).
        extra = [ENGINE + 2 * k + SIDE_CHANNEL_OFFSET for k in range(engines)]
        extra += range(UCX_PORTS_BASE, UCX_PORTS_BASE + engines * UCX_PORTS_PER_WORKER)
        env = {"PATH": f"{os.environ.get('PATH', os.defpath)}:{VLLM_BIN}", "HF_HUB_OFFLINE": "1"}
        super().__init__(
            tmp,
            "--engine-type",
            "vllm",
            "--model",
            str(TINY_MODEL),
            "--prefill",
            str(prefill),
            "--decode",
            str(decode),
            "--union",
            str(union),
            "--config",
            str(cfg),
            nodes=engines,
            env=env,
            extra_ports=extra,
        )

    def wait_all_active(self, timeout: float) -> None:
        """Until every instance is ACTIVE: READY means one request can be served, and with two
        union instances that is as soon as the first engine has loaded."""
        engines = self.nodes * self.dp
        wait_until(
            lambda: (
                sorted(i.get("status", "") for i in self.controller_instances())
                == ["INSTANCE_STATUS_ACTIVE"] * engines
            ),
            timeout,
            f"{engines} instances ACTIVE",
        )

    def keep_log(self) -> None:
        """Everything `motor up` and its engines wrote, kept beside the cluster's state (pytest
        keeps the last runs' temporary directories): the first thing to read when a test here
        fails."""
        log = self.state.parent / "motor-up.log"
        log.write_text(self.proc.output())
        print(f"motor up's output: {log}")

    def nm_status(self, i: int) -> dict[str, Any]:
        """NodeManager nm-<i>'s GetStatus answer."""
        return self.call(self.grpc(NM + i), "motor.v1.NodeManager/GetStatus")

    def engine_pid(self, i: int) -> int:
        """The pid (= process group) of NodeManager nm-<i>'s one engine; 0 = not running."""
        (ep,) = self.nm_status(i)["endpoints"]
        return int(ep.get("pid", 0))

    def engine_metrics(self, k: int) -> str:
        with urllib.request.urlopen(f"{self.engine_url(k)}/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
            return text

    def engine_block_size(self, k: int) -> int:
        """The KV cache block size engine ``k`` runs with (its vllm:cache_config_info)."""
        m = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', self.engine_metrics(k), re.M)
        assert m, "no vllm:cache_config_info with a block_size"
        return int(m.group(1))

    def engine_counter(self, k: int, name: str, **labels: str) -> float:
        """The sum of engine ``k``'s samples of counter ``name`` whose labels include ``labels``."""
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", self.engine_metrics(k), re.M):
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.items() <= have.items():
                total += float(m.group(2))
        return total


def client(c: RealCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def engine_client(c: RealCluster, k: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.engine_url(k)}/v1", api_key="none", max_retries=0, timeout=120)


def chat(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def unique(words: int = 12) -> str:
    """A prompt no engine has seen (so no cache can answer for it)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(words))


@contextlib.contextmanager
def running(c: RealCluster, start_s: float) -> Iterator[RealCluster]:
    """``c`` with every instance ACTIVE; stopped, and its output kept, however the tests end."""
    try:
        c.wait_ready(start_s)
        c.wait_all_active(start_s)
        yield c
    finally:
        c.cleanup()
        c.keep_log()
