"""``device_env = auto``: the variable follows the accelerators the machine has."""

from __future__ import annotations

from pathlib import Path

from services.nodemanager import devices


def test_auto_follows_the_machine(tmp_path: Path) -> None:
    dev, bin_dir = tmp_path / "dev", tmp_path / "bin"
    dev.mkdir()
    bin_dir.mkdir()
    empty = str(tmp_path / "nowhere")
    assert devices.resolve("auto", dev, empty) == ("CUDA_VISIBLE_DEVICES", "no NVIDIA or Ascend device found")
    (dev / "davinci_manager").touch()  # not a device
    assert devices.resolve("auto", dev, empty)[0] == "CUDA_VISIBLE_DEVICES"
    (dev / "davinci3").touch()
    assert devices.resolve("auto", dev, empty) == ("ASCEND_RT_VISIBLE_DEVICES", f"{dev / 'davinci3'} exists")
    (dev / "nvidia0").touch()
    assert devices.resolve("auto", dev, empty)[0] == "CUDA_VISIBLE_DEVICES"
    (dev / "nvidia0").unlink()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert devices.resolve("auto", dev, str(bin_dir)) == ("CUDA_VISIBLE_DEVICES", "nvidia-smi on PATH")


def test_a_configured_variable_is_kept(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    assert devices.resolve("MY_DEVICES", tmp_path, "") == ("MY_DEVICES", "configured")
