"""Which environment variable hands an engine its accelerators on this machine.

``nodemanager.device_env = "auto"`` picks it once at start-up from what the machine has: NVIDIA
GPUs (``nvidia-smi`` on PATH or ``/dev/nvidia0``) → ``CUDA_VISIBLE_DEVICES``; Ascend NPUs
(``/dev/davinci<N>``) → ``ASCEND_RT_VISIBLE_DEVICES``. A machine with neither (a laptop, CI) gets
``CUDA_VISIBLE_DEVICES``, which CPU builds of the engines ignore.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

AUTO = "auto"
CUDA = "CUDA_VISIBLE_DEVICES"
ASCEND = "ASCEND_RT_VISIBLE_DEVICES"
_DAVINCI = re.compile(r"davinci\d+$")


def detect(dev: Path = Path("/dev"), path: str | None = None) -> tuple[str, str]:
    """The device variable for this machine and the evidence for it."""
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
    return CUDA, "no NVIDIA or Ascend device found"


def resolve(configured: str, dev: Path = Path("/dev"), path: str | None = None) -> tuple[str, str]:
    """``configured`` itself unless it is ``auto``; then what :func:`detect` finds."""
    if configured != AUTO:
        return configured, "configured"
    return detect(dev, path)
