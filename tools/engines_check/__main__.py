"""``python -m tools.engines_check [--engines-dir DIR]``: Motor's launch lines against real engines.

Builds every case of the table (cases.py), checks the cross-process invariants, then hands the
launches to ``vllm_side.py`` and ``sglang_side.py`` running in ``DIR/vllm`` and ``DIR/sglang``
(venvs with the engines installed; ``make engines-check`` creates them). Both sides run at once:
most of their time is importing the engine. No GPU, no network: the engines get generated tiny
checkpoint configs (a MoE model and a dense one) and offline Hugging Face settings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import cases, invariants

HERE = Path(__file__).resolve().parent
SIDES = ("vllm", "sglang")
SIDE_TIMEOUT_S = 1800
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_ENDPOINT": "http://127.0.0.1:9",  # anything that still tries the hub fails at once
}

# A Mixtral-shaped model small enough to describe in a few numbers. It must be MoE: vLLM
# refuses external-LB data parallelism (--data-parallel-rank) for dense models. Config
# resolution reads only config.json; no weights or tokenizer are loaded.
TINY_MOE = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
# A Llama-shaped dense model, for the cases without a vLLM DP group.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
FIXTURES = {"moe": TINY_MOE, "dense": TINY_LLAMA}


def write_fixtures(root: Path) -> dict[str, str]:
    """Each model kind's checkpoint directory (config.json only), by kind."""
    out: dict[str, str] = {}
    for kind, config in FIXTURES.items():
        model = root / f"tiny-{kind}"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config, indent=1))
        out[kind] = str(model)
    return out


def check_table(table: dict[str, list[cases.Launch]]) -> int:
    """Print every case with its invariant problems; the number of problems."""
    failures = 0
    for name, launches in table.items():
        problems = invariants.check(launches)
        failures += len(problems)
        if not problems:
            instances = sorted({x["instance"] for x in launches})
            print(f"ok {name}: {len(launches)} launches ({', '.join(instances)})")
        for problem in problems:
            print(f"FAIL {name}: {problem}")
    return failures


def run_sides(engines_dir: Path, sides: list[str], launches_file: Path, work: Path) -> int:
    """Run each engine's side in its own venv, all at once; print their output in order."""
    env = {**os.environ, **OFFLINE}
    running: dict[str, subprocess.Popen[bytes]] = {}
    failed = 0
    for side in sides:
        python = engines_dir / side / "bin" / "python"
        if not python.exists():
            print(f"FAIL {side}: no venv at {engines_dir / side} (make engines-check creates it)")
            failed += 1
            continue
        argv = [str(python), str(HERE / f"{side}_side.py"), str(launches_file)]
        # Files, not pipes: neither side can stall on a full pipe while the other is awaited.
        with (work / f"{side}.out").open("wb") as out, (work / f"{side}.err").open("wb") as err:
            running[side] = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
    for side, proc in running.items():
        try:
            proc.wait(timeout=SIDE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"FAIL {side}: killed after {SIDE_TIMEOUT_S}s")
        print(f"---- {side} ({engines_dir / side}) ----")
        print((work / f"{side}.out").read_text(errors="replace"), end="")
        if proc.returncode != 0:
            failed += 1
            tail = (work / f"{side}.err").read_text(errors="replace").splitlines()[-30:]
            print(f"FAIL {side}: exit status {proc.returncode}; last stderr lines:")
            print("\n".join(f"  | {line}" for line in tail))
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.engines_check", description="Motor's launch lines against real engines."
    )
    ap.add_argument(
        "--engines-dir", type=Path, default=Path(".engines"), help="holds the vllm/ and sglang/ venvs"
    )
    ap.add_argument("--engine", choices=SIDES, action="append", help="check only this engine (repeatable)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    table = cases.build()
    sides = args.engine or list(SIDES)
    table = {name: ls for name, ls in table.items() if ls[0]["engine"] in sides}
    print(f"---- invariants ({len(table)} cases) ----")
    failures = check_table(table)
    with tempfile.TemporaryDirectory(prefix="engines-check-") as tmp:
        work = Path(tmp)
        # Each launch names its model kind; a side swaps that kind's placeholder for its fixture.
        doc = {"models": cases.MODELS, "fixtures": write_fixtures(work), "cases": table}
        launches_file = work / "launches.json"
        launches_file.write_text(json.dumps(doc, indent=1))
        failures += run_sides(args.engines_dir.resolve(), sides, launches_file, work)
    verdict = "FAILED" if failures else "passed"
    print(f"engines-check {verdict}: {len(table)} cases, {time.monotonic() - started:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
