"""What ``motor up`` does when the desired instance counts change (no process started): a
NodeManager added later is run as the first ones were, on numbers and ports no other holds, and
each pass of the follower takes the step from what runs to what is desired: the role's lowest free
numbers up, its highest-numbered instances down, a role with no recorded count left alone."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from motor_mesh.cli.up_args import parse
from motor_mesh.cli.up_plan import MAX_NODEMANAGERS, Child, Plan, plan
from motor_mesh.cli.up_scale import Scaler
from motor_mesh.common.config import load


def planned(tmp_path: Path, *argv: str, config: dict | None = None) -> tuple[argparse.Namespace, Plan]:
    args = list(argv)
    if config is not None:
        (tmp_path / "motor.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "motor.json")]
    parsed = parse(args)
    return parsed, plan(parsed, load(parsed.config, env={}), tmp_path / "state", cores=[0, 1, 2, 3])


def test_the_first_nodemanagers_are_made_as_the_later_ones_are(tmp_path: Path) -> None:
    _, p = planned(tmp_path, "--prefill", "1", "--decode", "2", "--port-offset", "50")
    again = [p.make_node(c.index, c.role, c.number) for c in p.nodes]
    assert [(c.name, c.argv, c.env, c.state_dir) for c in again] == [
        (c.name, c.argv, c.env, c.state_dir) for c in p.nodes
    ]
    assert [(c.role, c.number, c.index) for c in p.nodes] == [
        ("prefill", 0, 0),
        ("decode", 0, 1),
        ("decode", 1, 2),
    ]


def test_a_nodemanager_added_later_gets_the_ports_of_its_number(tmp_path: Path) -> None:
    _, p = planned(tmp_path, "--prefill", "1", "--decode", "1", "--dp", "2", "--port-offset", "50")
    added = p.make_node(4, "decode", 3)
    assert added.name == "nm-4"
    assert added.argv[-4:] == ["--port", str(7300 + 4 + 50), "--metrics-port", str(9300 + 4 + 50)]
    cfg = load(None, env=added.env).nodemanager
    assert cfg.job_name == "motor-sim-decode-3"
    assert cfg.role == "decode"
    # Engines 8 and 9 (NodeManager i owns i * dp .. i * dp + dp - 1), each on 10000 + 2k.
    assert list(cfg.ports) == [10000 + 2 * 8 + 50, 10000 + 2 * 9 + 50]
    assert added.env["MOTOR_UP_ENGINE_INDEX"] == "8"
    assert cfg.ucx_port_range == f"{18000 + 50 + 8 * 16}-{18000 + 50 + 10 * 16 - 1}"
    assert added.state_dir == tmp_path / "state" / "nm-4"
    # Past the first NodeManagers, the cores go round again: nm-4 shares nm-0's.
    assert cfg.cpu_cores == load(None, env=p.nodes[0].env).nodemanager.cpu_cores


def test_room_stops_at_what_the_port_scheme_holds(tmp_path: Path) -> None:
    _, p = planned(tmp_path, "--decode", "1")
    assert p.make_node.room(MAX_NODEMANAGERS - 1) is None
    assert "700 NodeManagers" in (p.make_node.room(MAX_NODEMANAGERS) or "")
    _, p = planned(tmp_path, "--decode", "1", "--dp", "4")
    assert p.make_node.room(249) is None
    assert "250 instances of 4 engines" in (p.make_node.room(250) or "")
    # A configured UCX range is split over the engines motor up started with: no room beyond.
    _, p = planned(tmp_path, "--decode", "2", config={"nodemanager": {"ucx_port_range": "40000-40031"}})
    assert p.make_node.room(1) is None
    assert "ucx_port_range" in (p.make_node.room(2) or "")


class Follower:
    """A Scaler over a plan, starting nothing: an added child is only recorded, a removal is
    only begun (its NodeManager stays in the plan, running, until the test lets it go)."""

    def __init__(self, tmp_path: Path, *argv: str) -> None:
        args, self.plan = planned(tmp_path, *argv)
        cluster = SimpleNamespace(plan=self.plan, stopping=asyncio.Event(), args=args)
        self.started: list[Child] = []
        self.retired: list[Child] = []

        async def start_node(child: Child) -> None:
            self.started.append(child)

        self.scaler = Scaler(cluster, start_node)  # type: ignore[arg-type]

        async def retire(child: Child, reason: str) -> None:
            self.retired.append(child)

        self.scaler.retire = retire  # type: ignore[method-assign]

    async def step(self, **desired: int) -> None:
        await self.scaler.step(desired)
        await asyncio.gather(*self.scaler.retiring)

    def gone(self, *names: str) -> None:
        """The removed NodeManagers ``names`` have exited: their numbers are free again."""
        self.plan.nodes[:] = [c for c in self.plan.nodes if c.name not in names]

    def running(self, role: str) -> list[tuple[str, int]]:
        return [(c.name, c.number) for c in self.scaler.running(role)]


async def test_each_pass_steps_from_what_runs_to_what_is_desired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = Follower(tmp_path, "--prefill", "1", "--decode", "1")
    await f.step(prefill=1, decode=3, union=0)
    assert [(c.name, c.role, c.number) for c in f.started] == [("nm-2", "decode", 1), ("nm-3", "decode", 2)]
    assert capsys.readouterr().err == "motor up: scaled decode: 1 -> 3 instances (started nm-2, nm-3)\n"
    await f.step(prefill=1, decode=3, union=0)  # level-triggered: nothing more to do
    assert len(f.started) == 2 and capsys.readouterr().err == ""

    # Down: the highest-numbered go; they are out of the count at once, but hold their numbers
    # until they are gone, so what is started meanwhile takes others.
    await f.step(decode=1)
    assert [c.name for c in f.retired] == ["nm-3", "nm-2"]
    assert all(c.retiring.is_set() for c in f.retired)
    assert (
        capsys.readouterr().err
        == "motor up: scaled decode: 3 -> 1 instances (draining and stopping nm-3, nm-2)\n"
    )
    assert f.running("decode") == [("nm-1", 0)]
    await f.step(decode=2)
    assert (f.started[-1].name, f.started[-1].number) == ("nm-4", 3)
    f.gone("nm-2", "nm-3")
    # A role motor up never started, and a count of 0.
    await f.step(union=1)
    assert (f.started[-1].name, f.started[-1].role, f.started[-1].number) == ("nm-2", "union", 0)
    await f.step(prefill=0)
    assert f.retired[-1].name == "nm-0"
    assert f.running("prefill") == []
    # A role with no recorded count is left as it runs.
    before = len(f.started), len(f.retired)
    await f.step()
    assert (len(f.started), len(f.retired)) == before


async def test_a_count_beyond_the_port_scheme_starts_what_fits_and_says_so_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = Follower(tmp_path, "--decode", "1", "--dp", "400")  # room for two NodeManagers of 400 engines
    await f.step(decode=5)
    assert [c.name for c in f.started] == ["nm-1"]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "motor up: cannot scale decode to 5 instances: motor up's ports have room for 2 instances of 400 engines",
        "motor up: scaled decode: 1 -> 2 instances (started nm-1)",
    ]
    await f.step(decode=5)
    assert capsys.readouterr().err == ""  # said once per count asked for
    await f.step(decode=6)
    assert "cannot scale decode to 6 instances" in capsys.readouterr().err
