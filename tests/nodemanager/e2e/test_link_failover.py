"""A NodeManager given several Controllers talks to the leader: it finds it past a dead address
and a standby, and when the leader dies and a standby takes over, it registers again with the
new leader (its instance id, engines untouched) and streams its heartbeats there."""

from __future__ import annotations

from pathlib import Path

from tests.fake_controller import FakeController, controllers
from tests.nodemanager.conftest import nm_config
from tests.poll import until
from tests.ports import reserved_pair, reserved_port


async def test_registration_finds_the_leader_past_a_dead_controller_and_a_standby(
    tmp_path: Path, start_nm
) -> None:
    dead = f"127.0.0.1:{reserved_port()}"  # nothing listens there
    standby, leader = FakeController(leading=False), FakeController()
    async with controllers(standby, leader) as (stand, lead):
        targets = f"{dead},{stand.address},{lead.address}"
        nm = await start_nm(nm_config(tmp_path, [reserved_pair()], job_name="job-a", controller=targets))
        await until(lambda: leader.beats(), 15, "beats to the leader")
        assert len(leader.registers) == 1 and standby.refused >= 1
        await nm.wait_line(f"address={lead.address}", start=0)
        # The leader was found within the first round: nothing was worth a warning.
        assert not any("event=register_failed" in line for line in nm.proc.lines)
        assert not any("event=heartbeat_stream_broken" in line for line in nm.proc.lines)


async def test_the_link_follows_a_standby_that_takes_over_from_a_dead_leader(
    tmp_path: Path, start_nm
) -> None:
    first, second = FakeController(), FakeController(leading=False)
    async with controllers(first, second) as (a, b):
        second.leader_hint = a.address
        cfg = nm_config(
            tmp_path,
            [reserved_pair()],
            job_name="job-a",
            controller=f"{a.address},{b.address}",
            suicide_threshold=1000,
        )
        nm = await start_nm(cfg)
        await until(lambda: first.beats(), 15, "beats to the leader A")
        pid = (await nm.start_engines(instance_id=42)).endpoints[0].pid
        await nm.wait_ready()
        await until(lambda: [e.pid for e in first.beats()[-1].endpoints] == [pid], 10, "A told of the engine")

        # A dies. B stands by a while longer, still naming A (its lease has not run out yet):
        # the node keeps searching, without registering anywhere.
        start = len(nm.proc.lines)
        await a.kill()
        await until(lambda: second.refused >= 4, 10, "the node asking B again and again")
        assert second.registers == []

        # B takes over, knowing nothing of the node's session: it is told to register again, and
        # does so with its instance id.
        second.leading = True
        reg = await until(lambda: second.registers and second.registers[0], 10, "a Register at B")
        assert (reg.instance_id, reg.job_name, reg.nm_port) == (42, "job-a", nm.port)
        beat = await until(lambda: second.beats() and second.beats()[-1], 10, "beats to B")
        assert (beat.node_id, beat.session_epoch) == (1, 1)
        assert [e.pid for e in beat.endpoints] == [pid]
        await nm.wait_line(f"event=controller_leader address={b.address}", start=start)
        n = len(second.beats())
        await until(lambda: len(second.beats()) >= n + 2, 10, "B keeps hearing from the node")

        # The engine was never touched.
        status = await nm.status()
        assert status.ready and [e.pid for e in status.endpoints] == [pid]
        assert nm.proc.popen.poll() is None
