"""``device_env = auto``: the variable follows the accelerators the machine has, and without any
the CPU is the platform, whose cores are split between the engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from motor_mesh.nodemanager import devices


def test_auto_follows_the_machine(tmp_path: Path) -> None:
    dev, bin_dir = tmp_path / "dev", tmp_path / "bin"
    dev.mkdir()
    bin_dir.mkdir()
    empty = str(tmp_path / "nowhere")
    # No accelerator: the CPU is the platform.
    assert devices.resolve("auto", dev, empty) == ("cpu", "no NVIDIA or Ascend device found")
    (dev / "davinci_manager").touch()  # not a device
    assert devices.resolve("auto", dev, empty)[0] == "cpu"
    (dev / "davinci3").touch()
    assert devices.resolve("auto", dev, empty) == ("ASCEND_RT_VISIBLE_DEVICES", f"{dev / 'davinci3'} exists")
    (dev / "nvidia0").touch()
    assert devices.resolve("auto", dev, empty)[0] == "CUDA_VISIBLE_DEVICES"
    (dev / "nvidia0").unlink()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert devices.resolve("auto", dev, str(bin_dir)) == ("CUDA_VISIBLE_DEVICES", "nvidia-smi on PATH")


def test_an_unreadable_dev_is_no_device(tmp_path: Path) -> None:
    assert devices.resolve("auto", tmp_path / "missing", "")[0] == "cpu"


def test_a_configured_variable_is_kept(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    assert devices.resolve("MY_DEVICES", tmp_path, "") == ("MY_DEVICES", "configured")
    # The CPU platform chosen explicitly, on a machine with a GPU.
    assert devices.resolve("cpu", tmp_path, "") == ("cpu", "configured")


@pytest.mark.parametrize(
    ("cores", "parts", "expected"),
    [
        (range(8), 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),  # even
        (range(10), 3, [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]),  # uneven: the first ones larger
        (range(4), 4, [(0,), (1,), (2,), (3,)]),
        ([0, 1], 3, [(0,), (1,), (0,)]),  # fewer cores than parts: one each, round-robin
        ([5], 2, [(5,), (5,)]),
        ([6, 2, 4, 0], 2, [(6, 2), (4, 0)]),  # contiguous in the order given
        ([], 2, [(), ()]),
    ],
)
def test_cores_split(cores: range | list[int], parts: int, expected: list[tuple[int, ...]]) -> None:
    assert devices.split_cores(list(cores), parts) == expected


def test_every_core_is_used_and_slices_differ_by_at_most_one() -> None:
    for n in range(1, 20):
        for parts in range(1, 8):
            slices = devices.split_cores(list(range(n)), parts)
            assert len(slices) == parts and all(slices)
            if n >= parts:
                assert [c for s in slices for c in s] == list(range(n))
                assert max(map(len, slices)) - min(map(len, slices)) <= 1
            else:
                assert sorted({s[0] for s in slices}) == list(range(n))


@pytest.mark.parametrize(
    ("cores", "text"),
    [
        ([0, 1, 2, 3], "0-3"),
        ([0, 2, 4], "0,2,4"),
        ([3], "3"),
        ([0, 1], "0-1"),
        ([9, 8, 0, 1, 2, 6], "0-2,6,8-9"),  # ascending whatever the order
        ([], ""),
    ],
)
def test_cpuset_form(cores: list[int], text: str) -> None:
    assert devices.cpuset(cores) == text


def test_available_cores_are_this_process_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    if hasattr(os, "sched_getaffinity"):
        assert devices.available_cores() == tuple(sorted(os.sched_getaffinity(0)))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1})
        assert devices.available_cores() == (1, 3)
        monkeypatch.delattr(os, "sched_getaffinity")
    # Where affinity cannot be asked: every core the OS counts.
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert devices.available_cores() == (0, 1, 2)
    assert devices.node_cores([]) == (0, 1, 2)
    assert devices.node_cores([7, 5]) == (7, 5)  # configured: as given
