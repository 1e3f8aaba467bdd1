"""A ``vllm`` executable that is the simulated engine, for benches of ``--engine-type vllm``.

The NodeManager launches ``vllm serve MODEL FLAGS...`` from the engine's PATH
(services/nodemanager/launch.py, ``build_argv``); put :func:`write`'s directory first on PATH
and it runs ``motor engine-sim serve MODEL FLAGS...`` instead, under the same pid (it execs),
so the Coordinator sees engines of type vllm: a real engine's tokenizer path (no built-in
tokenizer to fall back on), a real engine's hand-off.

Every flag ``_vllm_flags`` gives vLLM (``--served-model-name``, ``--host``, ``--port``,
``--tensor-parallel-size``, ``--data-parallel-size`` and, with a DP group, its address, RPC port
and rank, ``--headless``, ``--kv-transfer-config``, ``--kv-events-config``,
``--otlp-traces-endpoint``) is one engine-sim takes, so all are passed on as they are. The
multi-node ones (``--pipeline-parallel-size``, ``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``) engine-sim does not model: it logs each as ``event=unknown_flag`` and carries
on, as it does for any vLLM knob; none of them is given on one node with pp 1, as here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# `vllm serve MODEL ...` -> `python -m motor_mesh.cli engine-sim serve MODEL ...`, same pid.
SCRIPT = """#!{python}
import os, sys
os.execv(sys.executable, [sys.executable, "-m", "motor_mesh.cli", "engine-sim", *sys.argv[1:]])
"""


def write(bin_dir: Path) -> Path:
    """``bin_dir/vllm``; returns ``bin_dir``, to put first on the engines' PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "vllm"
    script.write_text(SCRIPT.format(python=sys.executable))
    script.chmod(0o755)
    return bin_dir


def env(bin_dir: Path) -> dict[str, str]:
    """What ``Up(env=...)`` needs for ``--engine-type vllm`` to start the stand-in: its directory
    first on PATH (and no hub access: the tokenizer is a local directory)."""
    path = os.environ.get("PATH", os.defpath)
    return {"PATH": f"{write(bin_dir)}{os.pathsep}{path}", "HF_HUB_OFFLINE": "1"}
