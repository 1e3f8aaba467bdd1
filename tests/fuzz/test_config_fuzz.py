"""Every configuration key (read from the schema, so a new key is covered too) given wrong types,
extremes, NaN and infinities, huge and odd strings, unknown keys and nested garbage, through
each way a value arrives: a sectioned file, a flat file, a ``MOTOR_<SECTION>_<KEY>`` variable
and a command-line override.

Loading either succeeds with a valid configuration (every value passes its key's check again,
the typed sections build, no string holds a NUL that would break an argv, a path or a bind) or
raises the one ConfigError whose lines ``motor config check`` and the services print: one line
each, bounded in length, naming where the problem is. Nothing else is ever raised.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from motor_mesh.cli import config_cmd
from motor_mesh.common.config import DEFAULTS, SECTIONS, ConfigError, from_dicts, load_config
from motor_mesh.common.config.sections import SCHEMA, to_json
from motor_mesh.nodemanager.launch import extra_args
from tests.fuzz.harness import fuzz

KEYS = [(section, key) for section in SECTIONS for key in DEFAULTS[section]]
MAX_LINE = 600  # an error line quotes values shortened; it never floods the terminal

HUGE_DIGITS = "1" + "0" * 5000  # an integer past Python's int-from-text digit limit
WRONG_TYPES: list[Any] = [None, True, False, 0, -1, 1.5, "", "x", [], {}, [[]], {"a": {}}]
NUMBERS: list[Any] = [
    -1, 0, 1, 2, -(2**63), 2**63, 2**64, 10**100, 65535, 65536, 2**31 - 1, 2**31,
    -0.0, 0.5, 1.0, 1e-300, 5e-324, 1e308, -1e308, math.nan, math.inf, -math.inf,
]  # fmt: skip
STRINGS: list[Any] = [
    "", " ", "\x00", "a\x00b", "a\nb", "\r\n", "\t", "\x1b[31mred", "\u202eevil", "\ud800", "é" * 10,
    "x" * 100_000, "127.0.0.1:99999", "[::1]:0", ":80", "host:", "http://", "https://x y", "-", "--help",
    "../../etc/passwd", "/dev/null", "C:\\x", "null", "true", "0", "{}", "🙂",
]  # fmt: skip
COLLECTIONS: list[Any] = [
    [1] * 10_000, list(range(100)), [None], [1, 1], ["127.0.0.1:7200"] * 2, [[[[]]]],
    {"dp": -1}, {"dp": 0}, {"dp": 2**40}, {"dp": 1.0}, {"dp": True}, {"nnodes": 3, "tp": 2},
    {"unknown": 1}, {"": ""}, {"a": "\x00"}, {"\x00": "a"}, {"a=b": "c"}, {"k": [1, {"x": math.nan}]},
    {"k" * 1000: "v" * 1000}, {"nested": {"deeper": {"deepest": [True, None, 1e308]}}},
]  # fmt: skip


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": [value]}
    return value


ANY_VALUE = st.one_of(
    st.sampled_from(WRONG_TYPES + NUMBERS + STRINGS + COLLECTIONS),
    st.builds(_nested, st.sampled_from([50, 400])),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
        max_leaves=8,
    ),
)


def _key_like(key: str) -> st.SearchStrategy[str]:
    """Names that are not this key: typos, case, padding, garbage."""
    return st.sampled_from(
        [
            key + "x",
            key[:-1],
            key.upper(),
            " " + key,
            key + "\x00",
            key.replace("_", "-"),
            "",
            "\x00",
            "a" * 5000,
        ]
    )


def _json_text(value: Any) -> str:
    """JSON text for ``value``, with NaN/Infinity spelt as Python's json does (and reads)."""
    return json.dumps(value, allow_nan=True)


def _only_config_errors(**kw: Any) -> dict[str, dict[str, Any]] | None:
    """load_config(**kw): the config, or None after checking its ConfigError is well-formed."""
    try:
        return load_config(**kw)
    except ConfigError as err:
        assert err.errors, "a ConfigError with nothing in it"
        for line in err.errors:
            assert isinstance(line, str) and line, err.errors
            assert "\n" not in line and "\r" not in line, f"an error over several lines: {line!r}"
            assert len(line) <= MAX_LINE, f"an error line of {len(line)} characters: {line[:200]!r}..."
            assert "Traceback" not in line
        assert str(err) == "\n".join(err.errors)
        return None


def _no_nul(value: Any, where: str) -> None:
    if isinstance(value, str):
        assert "\x00" not in value, f"{where} holds a NUL character"
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nul(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nul(k, f"{where} key")
            _no_nul(v, f"{where}.{k}")


def _valid(cfg: dict[str, dict[str, Any]]) -> None:
    """What loading promises when it succeeds: every key of every section, each passing its own
    check as stored, typed sections that hold the same values, and nothing unusable."""
    assert set(cfg) == set(SECTIONS)
    typed = from_dicts(cfg)
    for section in SECTIONS:
        assert set(cfg[section]) == set(DEFAULTS[section])
        for key, value in cfg[section].items():
            stored, problems = SCHEMA[section][key][1](value)
            assert not problems, f"{section}.{key} = {value!r} was loaded but fails its check: {problems}"
            assert to_json(getattr(typed.section(section), key)) == to_json(stored)
            _no_nul(value, f"{section}.{key}")
            default = DEFAULTS[section][key]
            if isinstance(default, bool):
                assert isinstance(value, bool)
            elif isinstance(default, int) and not isinstance(default, bool) and key != "parallel":
                assert isinstance(value, int | float) and not isinstance(value, bool)
                assert math.isfinite(value), f"{section}.{key} = {value}"
    for arg in extra_args(typed.engine.args):  # what every engine's argv gets
        assert "\x00" not in arg


@pytest.fixture
def cfg_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _write(d: Path, text: str) -> str:
    path = d / "cfg.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return str(path)


@fuzz(300)
@given(key=st.sampled_from(KEYS), value=ANY_VALUE)
def test_any_value_of_any_key_through_every_channel(cfg_dir: Path, key: tuple[str, str], value: Any) -> None:
    section, name = key
    loaded = [
        _only_config_errors(path=_write(cfg_dir, _json_text({section: {name: value}})), env={}),
        _only_config_errors(path=_write(cfg_dir, _json_text({name: value})), section=section, env={}),
        _only_config_errors(env={f"MOTOR_{section.upper()}_{name.upper()}": _json_text(value)}),
        _only_config_errors(overrides={section: {name: value}}, env={}),
    ]
    if isinstance(value, str) and "\x00" not in value and "\ud800" not in value:  # as a raw variable
        loaded.append(_only_config_errors(env={f"MOTOR_{section.upper()}_{name.upper()}": value}))
    for cfg in loaded:
        if cfg is not None:
            _valid(cfg)


@fuzz(100)
@given(key=st.sampled_from(KEYS), data=st.data())
def test_unknown_keys_are_named(cfg_dir: Path, key: tuple[str, str], data: st.DataObject) -> None:
    section, name = key
    wrong = data.draw(_key_like(name))
    if wrong in SCHEMA[section]:
        return
    path = _write(cfg_dir, json.dumps({section: {wrong: 1}}))
    assert _only_config_errors(path=path, env={}) is None
    assert _only_config_errors(overrides={section: {wrong: 1}}, env={}) is None
    if wrong and "\x00" not in wrong and "=" not in wrong:
        var = f"MOTOR_{section.upper()}_{wrong.upper()}"
        if var != f"MOTOR_{section.upper()}_{name.upper()}":
            assert _only_config_errors(env={var: "1"}) is None


@fuzz(150)
@given(
    doc=st.dictionaries(
        st.sampled_from([*SECTIONS, "", "Controller", "x" * 300]) | st.text(max_size=10),
        st.dictionaries(st.sampled_from([k for _, k in KEYS]) | st.text(max_size=8), ANY_VALUE, max_size=6)
        | ANY_VALUE,
        max_size=5,
    ),
    section=st.sampled_from([None, *SECTIONS]),
)
def test_whole_documents(cfg_dir: Path, doc: dict[str, Any], section: str | None) -> None:
    """Several keys, several sections, wrong shapes at every level: every error together."""
    cfg = _only_config_errors(path=_write(cfg_dir, _json_text(doc)), section=section, env={})
    if cfg is not None:
        _valid(cfg)


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "{", "}", "[]", "null", "1", '"x"', "NaN", "{\"controller\": NaN}", "\ufeff{}", "\ufeff\ufeff{}",
        '{"controller": {"port": ' + HUGE_DIGITS + "}}", '{"controller": {"port": 1e999}}',
        '{"controller": {"port": -0}}', '{"controller": {"port": 7100.0}}', '{"controller": {"port": 0x10}}',
        '{"controller": {"host": "\\ud800"}}', '{"controller": {"host": "\\u0000"}}',
        '{"controller": {"port": 1, "port": 1}}', '{"controller": {}, "controller": {}}',
        '{"nodemanager": {"parallel": ' + "[" * 100_000 + "]" * 100_000 + "}}",
        '{"engine": {"args": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}}",
        '{"engine": {"args": {"x": "a\\u0000b"}}}', '{"engine": {"args": {"\\u0000": true}}}',
        '{"engine": {"env": {"A": "\\u0000"}}}', '{"nodemanager": {"model": "a\\u0000b"}}',
        '{"controller": {"coordinators": ["a\\u0000b:1"]}}', '{"controller": {"alarm_webhook_url": "http://a\\u0000b"}}',
        "// comment\n{}", "{,}", '{"a":1,}', "\x00", "{\"controller\": {\"port\": 1}} trailing",
    ],
)  # fmt: skip
def test_odd_files(cfg_dir: Path, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    for section in (None, "controller"):
        path = _write(cfg_dir, text)
        cfg = _only_config_errors(path=path, section=section, env={})
        if cfg is not None:
            _valid(cfg)
        # What an operator runs: every error one line on stderr and exit 1, or OK.
        argv = ["check", path, *(["--section", section] if section else [])]
        code = config_cmd.main(argv)
        out, err = capsys.readouterr()
        if cfg is None:
            assert code == 1 and out == "" and err.strip() and "Traceback" not in err
        elif section is not None or code == 0:
            assert code == 0 and out == "OK\n", err


def test_paths_that_are_not_config_files(cfg_dir: Path) -> None:
    weird = cfg_dir / "new\nline\x1b.json"  # a legal file name; the errors stay one line each
    weird.write_text('{"controller": {"port": "x", "portt": 1}}')
    for path in (str(cfg_dir), str(cfg_dir / "missing.json"), "/dev/null", "", "a\x00b", str(weird)):
        assert _only_config_errors(path=path, section="controller", env={}) is None, path
    (cfg_dir / "binary.json").write_bytes(b"\xff\xfe\x00{")
    assert _only_config_errors(path=str(cfg_dir / "binary.json"), env={}) is None


@fuzz(100)
@given(
    env=st.dictionaries(
        st.sampled_from([f"MOTOR_{s.upper()}_{k.upper()}" for s, k in KEYS])
        | st.text(alphabet="MOTRCNLEGIDAP_x", max_size=30).map(lambda s: "MOTOR_" + s),
        st.sampled_from(
            [_json_text(v) for v in WRONG_TYPES + NUMBERS[:12]] + [s for s in STRINGS if "\x00" not in s]
        )
        | st.text(max_size=20),
        max_size=6,
    )
)
def test_environments(env: dict[str, str]) -> None:
    cfg = _only_config_errors(env=env)
    if cfg is not None:
        _valid(cfg)


@pytest.mark.parametrize("value", [b"bytes", (1, 2), {1, 2}, object(), 1 + 2j, float("nan"), Path("/x")])
@pytest.mark.parametrize("key", KEYS[:: max(1, len(KEYS) // 12)])
def test_overrides_of_python_types(key: tuple[str, str], value: Any) -> None:
    """Command-line overrides are Python values (argparse results): any of them too."""
    section, name = key
    cfg = _only_config_errors(overrides={section: {name: value}}, env={})
    if cfg is not None:
        _valid(cfg)
