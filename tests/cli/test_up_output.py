"""``motor up``'s handling of a child's output: any line length, any failure, the pipe keeps
draining; and the line that says why a child failed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

import pytest

from motor_mesh.cli.up_output import error_line, pump
from motor_mesh.common.lines import CUT as TRUNCATED
from motor_mesh.common.lines import MAX_LINE, LineSplitter

MARK = TRUNCATED % MAX_LINE


def split_all(chunks: list[bytes], max_line: int = MAX_LINE) -> list[bytes]:
    s = LineSplitter(max_line)
    return [line for c in chunks for line in s.feed(c)] + s.flush()


def test_lines_come_out_whole_however_the_bytes_arrive() -> None:
    data = b"one\ntwo\n\nthree\n"
    expected = [b"one\n", b"two\n", b"\n", b"three\n"]
    assert split_all([data]) == expected
    assert split_all([bytes([b]) for b in data]) == expected


def test_a_long_line_is_cut_with_a_marker_and_the_next_line_is_intact() -> None:
    got = split_all([b"x" * 10 + b"\n", b"y" * 25, b"y" * 25 + b"\nafter\n"], max_line=16)
    mark = TRUNCATED % 16
    assert got == [b"x" * 10 + b"\n", b"y" * 16 + mark + b"\n", b"after\n"]
    # Exactly max_line bytes fit.
    assert split_all([b"z" * 16 + b"\n"], max_line=16) == [b"z" * 16 + b"\n"]


def test_a_last_line_without_newline_is_kept() -> None:
    assert split_all([b"done\nhalf a li", b"ne"]) == [b"done\n", b"half a line\n"]
    assert split_all([b"w" * 40], max_line=16) == [b"w" * 16 + TRUNCATED % 16 + b"\n"]


async def child_output(code: str, on_line: Callable[[bytes], None]) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert proc.stdout is not None
    await asyncio.wait_for(pump("child", proc.stdout, on_line), 30)
    return await asyncio.wait_for(proc.wait(), 30)


@pytest.mark.timeout(60)
async def test_a_child_writing_megabyte_lines_is_never_blocked() -> None:
    # Far more than a pipe holds, in lines far longer than a StreamReader's limit.
    code = (
        "import sys\n"
        "for i in range(3):\n"
        "    sys.stdout.write('%d' % i + 'x' * 1_000_000 + '\\n')\n"
        "sys.stdout.write('after\\n')\n"
        "sys.stdout.write('no newline at the end')\n"
    )
    lines: list[bytes] = []
    assert await child_output(code, lines.append) == 0
    assert [len(line) for line in lines[:3]] == [MAX_LINE + len(MARK) + 1] * 3
    assert [line[:1] for line in lines[:3]] == [b"0", b"1", b"2"]
    assert all(line.endswith(MARK + b"\n") for line in lines[:3])
    assert lines[3:] == [b"after\n", b"no newline at the end\n"]


@pytest.mark.timeout(60)
async def test_a_failing_consumer_is_logged_once_and_the_pipe_still_drains(capsys) -> None:
    from motor_mesh.common import log

    log.setup("up")
    seen: list[bytes] = []

    def broken(line: bytes) -> None:
        seen.append(line)
        raise BrokenPipeError("stderr is gone")

    code = "import sys\nfor i in range(20000):\n    sys.stdout.write('line %d\\n' % i)\n"
    assert await child_output(code, broken) == 0  # the child ran to its end: never blocked
    assert len(seen) == 20000
    err = capsys.readouterr().err
    assert err.count("event=output_failed") == 1
    assert "BrokenPipeError: stderr is gone" in err and "traceback=" in err


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"motor controller: cannot bind gRPC 127.0.0.1:7100: address in use\n", None),
        (b"error: state file /x/controller.db is corrupt (bad); moved it\n", None),
        (b"Traceback (most recent call last):\n", "-"),
        (b'  File "/x.py", line 3, in <module>\n', "-"),
        (b"ValueError: no\n", None),
        (b"ts=1 level=info service=controller event=listening grpc=127.0.0.1:7100\n", "-"),
        (
            b'ts=1 level=error service=nodemanager event=start_failed reason="port \\"x\\" taken\\x1b"\n',
            'start_failed: port "x" taken\\x1b',
        ),
        (b'{"ts":"1","level":"error","event":"crashed","error":"KeyError: 1"}\n', "crashed: KeyError: 1"),
        (b'{"ts":"1","level":"info","event":"listening"}\n', "-"),
        (b"plain with a \x1b[31m colour\r\n", "plain with a \\x1b[31m colour"),
        (b"\n", "-"),
    ],
)
def test_the_error_line_of_a_child(line: bytes, expected: str | None) -> None:
    """None: the line itself; "-": not an error line."""
    want = line.decode().rstrip("\r\n") if expected is None else None if expected == "-" else expected
    assert error_line(line) == want
