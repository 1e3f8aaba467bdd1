"""What hands an engine its share of the machine: an accelerator variable, or CPU cores.

``nodemanager.device_env = "auto"`` picks the platform once at start-up from what the machine
has: NVIDIA GPUs (``nvidia-smi`` on PATH or ``/dev/nvidia0``) → ``CUDA_VISIBLE_DEVICES``; Ascend
NPUs (``/dev/davinci<N>``) → ``ASCEND_RT_VISIBLE_DEVICES``; neither (a CPU server, a laptop,
CI) → ``cpu``, the CPU platform, where each engine gets its own cores instead of devices (CPU
builds of vLLM and SGLang read their core list from ``VLLM_CPU_OMP_THREADS_BIND`` /
``SGLANG_CPU_OMP_THREADS_BIND``; launch.py sets them).

Core lists are kept in the order given: splitting them contiguously in that order is what lets
``motor up`` hand each NodeManager the cores its engines get in the cluster-wide split.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

AUTO = "auto"
CPU = "cpu"
CUDA = "CUDA_VISIBLE_DEVICES"
ASCEND = "ASCEND_RT_VISIBLE_DEVICES"
_DAVINCI = re.compile(r"davinci\d+$")


def detect(dev: Path = Path("/dev"), path: str | None = None) -> tuple[str, str]:
    """The platform of this machine (a device variable, or ``cpu``) and the evidence for it."""
    if shutil.which("nvidia-smi", path=os.environ.get("PATH", os.defpath) if path is None else path):
        return CUDA, "nvidia-smi on PATH"
    if (dev / "nvidia0").exists():
        return CUDA, f"{dev / 'nvidia0'} exists"
    try:
        davinci = sorted(p.name for p in dev.iterdir() if _DAVINCI.match(p.name))
    except OSError:
        davinci = []
    if davinci:
        return ASCEND, f"{dev / davinci[0]} exists"
    return CPU, "no NVIDIA or Ascend device found"


def resolve(configured: str, dev: Path = Path("/dev"), path: str | None = None) -> tuple[str, str]:
    """``configured`` itself unless it is ``auto``; then what :func:`detect` finds."""
    if configured != AUTO:
        return configured, "configured"
    return detect(dev, path)


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity, which a cgroup or ``taskset`` narrows);
    every core the OS counts where affinity cannot be asked (not Linux)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return tuple(sorted(getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def node_cores(configured: Sequence[int]) -> tuple[int, ...]:
    """The cores this node's engines share: ``nodemanager.cpu_cores``, or all of ours."""
    return tuple(configured) or available_cores()


def split_cores(cores: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``cores`` in ``parts`` contiguous slices of (almost) equal size, the larger ones first.
    With fewer cores than parts, part k gets the single core ``cores[k % len(cores)]``: every
    part gets one, and parts share them round-robin."""
    if not cores or parts < 1:
        return [() for _ in range(max(parts, 0))]
    if len(cores) < parts:
        return [(cores[k % len(cores)],) for k in range(parts)]
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(tuple(cores[start:end]))
        start = end
    return out


def cpuset(cores: Sequence[int]) -> str:
    """``cores`` in the compact cpuset list form: ``0-3,6``; ascending, each core once."""
    ranges: list[list[int]] = []
    for core in sorted(set(cores)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in ranges)
