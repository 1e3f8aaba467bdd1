"""Log lines stay one line of printable text, whatever the logged values hold."""

from __future__ import annotations

import json
import re

import pytest

from motor_mesh.common import log

# A job name that tries to end the line, repaint the terminal red and forge an event.
FORGED = "\r\x1b[31mFAKE event=ok\n"
# Anything a terminal or a line splitter acts on: C0, DEL, C1, Unicode line separators.
RAW_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def emitted(capsys: pytest.CaptureFixture[str], fmt: str, **fields: object) -> str:
    log.setup("test", fmt)
    log.event("registered", **fields)
    err = capsys.readouterr().err
    assert err.endswith("\n")
    lines = err[:-1].split("\n")
    assert len(lines) == 1, err
    (line,) = lines
    assert not RAW_CONTROL.search(line), repr(line)
    assert len(line.splitlines()) == 1
    return line


def test_a_forged_job_name_stays_inside_its_value_in_kv(capsys) -> None:
    line = emitted(capsys, "kv", job_name=FORGED, instance_id=7)
    assert r'job_name="\r\x1b[31mFAKE event=ok\n"' in line
    # Split as a kv parser would: the forged "event=ok" is inside the quoted value.
    pairs = re.findall(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|\S*)(?: |$)', line)
    assert [k for k, _ in pairs] == ["ts", "level", "service", "event", "job_name", "instance_id"]
    assert dict(pairs)["event"] == "registered"
    assert " ".join(f"{k}={v}" for k, v in pairs) == line


def test_a_forged_job_name_is_escaped_in_json(capsys) -> None:
    line = emitted(capsys, "json", job_name=FORGED)
    assert json.loads(line)["job_name"] == FORGED  # escaped on the line, intact for a parser


@pytest.mark.parametrize("fmt", ["kv", "json"])
def test_every_control_character_is_escaped_in_values_and_keys(capsys, fmt: str) -> None:
    nasty = "".join(map(chr, range(0x20))) + "\x7f" + "".join(map(chr, range(0x80, 0xA0)))
    nasty += "\u2028\u2029\u202e"
    line = emitted(capsys, fmt, **{"field\x1b[2J": nasty, "nested": {"k\n": [nasty]}})
    if fmt == "json":
        fields = json.loads(line)
        assert fields["field\x1b[2J"] == nasty and fields["nested"] == {"k\n": [nasty]}
    else:
        assert r"field\x1b[2J=" in line and r"\x00\x01" in line and r"\x7f\x80" in line
        assert r"\u2028\u2029\u202e" in line


def test_quiet_values_stay_unquoted_and_unicode_stays_readable(capsys) -> None:
    line = emitted(capsys, "kv", grpc="127.0.0.1:7100", model="模型", path="C:\\x1b", empty="")
    assert " grpc=127.0.0.1:7100 model=模型 " in line
    # A literal backslash is escaped too, so it cannot pass for an escape sequence.
    assert r'path="C:\\x1b"' in line and line.endswith(' empty=""')


def test_secrets_are_still_redacted(capsys) -> None:
    line = emitted(capsys, "kv", api_key="sk-\x1b123", management_key_file="/etc/motor/key")
    assert "api_key=<redacted>" in line and "sk-" not in line
    assert "management_key_file=/etc/motor/key" in line


def test_a_traceback_is_one_escaped_line(capsys) -> None:
    log.setup("test", "kv")
    try:
        raise ValueError("bad\x1b[31m value\nsecond line")
    except ValueError:
        log.exception("failed", job_name=FORGED)
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert not RAW_CONTROL.search(line)
    assert r'error="ValueError: bad\x1b[31m value\nsecond line"' in line
    assert 'traceback="Traceback (most recent call last):\\n' in line


def test_messages_of_other_libraries_are_escaped(capsys) -> None:
    import logging

    log.setup("test", "kv")
    logging.getLogger("grpc").warning("peer said %s", "hi\r\n\x1b[Aforged")
    (line,) = capsys.readouterr().err.splitlines()
    assert r'msg="peer said hi\r\n\x1b[Aforged"' in line


def test_printable_escapes_controls_only() -> None:
    assert log.printable('say "hi"\x1b[0m\n') == r'say "hi"\x1b[0m\n'
