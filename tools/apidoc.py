#!/usr/bin/env python3
"""Render the gRPC API reference, docs/api.md, from protos/motor/v1/*.proto and their comments.

    python tools/apidoc.py           # write docs/api.md
    python tools/apidoc.py --check   # exit 1 when docs/api.md is not what this would write

Run it with the repository's virtualenv (``make docs``): it compiles the protos with
``python -m grpc_tools.protoc --include_source_info --include_imports --descriptor_set_out`` and
reads the comments from the descriptor set's SourceCodeInfo. The introduction (how to call the
API, the management key, health, errors) is tools/api_intro.md. The output depends only on those
files, so it is the same on every machine.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "motor" / "v1"
OUTPUT = ROOT / "docs" / "api.md"
PACKAGE = "motor.v1"

FieldProto = descriptor_pb2.FieldDescriptorProto

# Field numbers inside descriptor.proto, as they appear in SourceCodeInfo location paths.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE = 2
SERVICE_METHOD = 2

SCALARS: dict[int, str] = {
    FieldProto.TYPE_DOUBLE: "double",
    FieldProto.TYPE_FLOAT: "float",
    FieldProto.TYPE_INT64: "int64",
    FieldProto.TYPE_UINT64: "uint64",
    FieldProto.TYPE_INT32: "int32",
    FieldProto.TYPE_FIXED64: "fixed64",
    FieldProto.TYPE_FIXED32: "fixed32",
    FieldProto.TYPE_BOOL: "bool",
    FieldProto.TYPE_STRING: "string",
    FieldProto.TYPE_BYTES: "bytes",
    FieldProto.TYPE_UINT32: "uint32",
    FieldProto.TYPE_SFIXED32: "sfixed32",
    FieldProto.TYPE_SFIXED64: "sfixed64",
    FieldProto.TYPE_SINT32: "sint32",
    FieldProto.TYPE_SINT64: "sint64",
}

WELL_KNOWN_URL = "https://protobuf.dev/reference/protobuf/google.protobuf/#{}"

# The hand-written part of docs/api.md: calling conventions, the key, health, errors.
INTRO = Path(__file__).resolve().with_name("api_intro.md")


@dataclass(frozen=True)
class Message:
    """A message type to render: its full name (without the leading dot), file and comments."""

    full_name: str
    file: str
    proto: descriptor_pb2.DescriptorProto
    path: tuple[int, ...]


@dataclass(frozen=True)
class Enum:
    full_name: str
    file: str
    proto: descriptor_pb2.EnumDescriptorProto
    path: tuple[int, ...]


class Comments:
    """The comments of one .proto file, by SourceCodeInfo path."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self._by_path: dict[tuple[int, ...], descriptor_pb2.SourceCodeInfo.Location] = {
            tuple(loc.path): loc for loc in file.source_code_info.location
        }

    def get(self, path: tuple[int, ...]) -> str:
        loc = self._by_path.get(path)
        if loc is None:
            return ""
        return clean_comment("\n".join(c for c in (loc.leading_comments, loc.trailing_comments) if c))


def clean_comment(raw: str) -> str:
    """The comment as text: one leading space per line removed, buf lint directives dropped,
    surrounding blank lines trimmed, inner blank lines (paragraph breaks) collapsed to one."""
    lines = []
    for line in raw.splitlines():
        line = line.removeprefix(" ").rstrip()
        if line.startswith("buf:lint:"):
            continue
        lines.append(line)
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def _escape(text: str, in_table: bool) -> str:
    text = text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return text.replace("|", "\\|") if in_table else text


def inline(text: str, *, in_table: bool = False) -> str:
    """Markdown for comment text: HTML-like and emphasis characters escaped outside code spans;
    in a table cell, pipes escaped everywhere and paragraphs joined with line breaks."""
    if in_table:
        paragraphs = [" ".join(p.split("\n")) for p in text.split("\n\n")]
        text = "<br>".join(paragraphs)
    out: list[str] = []
    pos = 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape(text[pos : match.start()], in_table))
        span = match.group(0)
        out.append(span.replace("|", "\\|") if in_table else span)
        pos = match.end()
    out.append(_escape(text[pos:], in_table))
    return "".join(out)


def anchor(full_name: str) -> str:
    return f'<a id="{full_name}"></a>'


def short_name(full_name: str) -> str:
    return full_name.removeprefix(PACKAGE + ".")


class Api:
    """Everything in package motor.v1, in file order (files sorted by name), then declaration
    order inside each file."""

    def __init__(self, fds: descriptor_pb2.FileDescriptorSet) -> None:
        self.files = sorted((f for f in fds.file if f.package == PACKAGE), key=lambda f: f.name)
        self.comments = {f.name: Comments(f) for f in self.files}
        self.messages: list[Message] = []
        self.enums: list[Enum] = []
        self.map_entries: dict[str, descriptor_pb2.DescriptorProto] = {}
        for f in self.files:
            for i, msg in enumerate(f.message_type):
                self._add_message(f.name, f"{PACKAGE}.{msg.name}", msg, (FILE_MESSAGE, i))
            for i, enum in enumerate(f.enum_type):
                self.enums.append(Enum(f"{PACKAGE}.{enum.name}", f.name, enum, (FILE_ENUM, i)))
        self.known = {m.full_name for m in self.messages} | {e.full_name for e in self.enums}

    def _add_message(
        self, file: str, full_name: str, msg: descriptor_pb2.DescriptorProto, path: tuple[int, ...]
    ) -> None:
        if msg.options.map_entry:
            self.map_entries[full_name] = msg
            return
        self.messages.append(Message(full_name, file, msg, path))
        for i, nested in enumerate(msg.nested_type):
            self._add_message(file, f"{full_name}.{nested.name}", nested, (*path, MESSAGE_NESTED, i))
        for i, enum in enumerate(msg.enum_type):
            self.enums.append(Enum(f"{full_name}.{enum.name}", file, enum, (*path, MESSAGE_ENUM, i)))

    # ---- types -------------------------------------------------------------------------------

    def type_link(self, type_name: str) -> str:
        """A link to a message or enum type (``type_name`` as in a descriptor: ``.pkg.Name``)."""
        name = type_name.lstrip(".")
        if name in self.known:
            return f"[{short_name(name)}](#{name})"
        if name.startswith("google.protobuf."):
            last = name.rsplit(".", 1)[1]
            return f"[{name}]({WELL_KNOWN_URL.format(last.lower())})"
        return f"`{name}`"

    def value_type(self, field: FieldProto) -> str:
        if field.type in (FieldProto.TYPE_MESSAGE, FieldProto.TYPE_ENUM):
            return self.type_link(field.type_name)
        return f"`{SCALARS[field.type]}`"

    def field_type(self, field: FieldProto, msg: descriptor_pb2.DescriptorProto) -> str:
        entry = self.map_entries.get(field.type_name.lstrip("."))
        if entry is not None:
            key, value = entry.field[0], entry.field[1]
            return f"map&lt;{self.value_type(key)}, {self.value_type(value)}&gt;"
        text = self.value_type(field)
        if field.label == FieldProto.LABEL_REPEATED:
            return f"repeated {text}"
        if field.HasField("oneof_index") and not field.proto3_optional:
            return f"{text} (oneof `{msg.oneof_decl[field.oneof_index].name}`)"
        if field.proto3_optional:
            return f"optional {text}"
        return text

    def streamed(self, type_name: str, streaming: bool) -> str:
        link = self.type_link(type_name)
        return f"stream {link}" if streaming else link

    # ---- sections ----------------------------------------------------------------------------

    def contents(self) -> Iterator[str]:
        yield "## Contents"
        yield ""
        yield "- [Services](#services)"
        for f in self.files:
            for service in f.service:
                full = f"{PACKAGE}.{service.name}"
                rpcs = ", ".join(f"[{m.name}](#{full}.{m.name})" for m in service.method)
                yield f"  - [{service.name}](#{full}): {rpcs}"
        for title, items in (("Messages", self.messages), ("Enums", self.enums)):
            yield f"- [{title}](#{title.lower()})"
            for f in self.files:
                links = [f"[{short_name(t.full_name)}](#{t.full_name})" for t in items if t.file == f.name]
                if links:
                    yield f"  - `{f.name}`: " + ", ".join(links)
        yield ""

    def services(self) -> Iterator[str]:
        yield "## Services"
        yield ""
        for f in self.files:
            comments = self.comments[f.name]
            for i, service in enumerate(f.service):
                full = f"{PACKAGE}.{service.name}"
                yield anchor(full)
                yield f"### {service.name}"
                yield ""
                yield f"`{full}`, defined in `{f.name}`."
                yield ""
                text = comments.get((FILE_SERVICE, i))
                if text:
                    yield inline(text)
                    yield ""
                yield "| RPC | request | response |"
                yield "|---|---|---|"
                for method in service.method:
                    yield (
                        f"| [{method.name}](#{full}.{method.name}) "
                        f"| {self.streamed(method.input_type, method.client_streaming)} "
                        f"| {self.streamed(method.output_type, method.server_streaming)} |"
                    )
                yield ""
                for j, method in enumerate(service.method):
                    yield from self.method(full, method, comments.get((FILE_SERVICE, i, SERVICE_METHOD, j)))

    def method(self, service: str, method: descriptor_pb2.MethodDescriptorProto, text: str) -> Iterator[str]:
        name = service.rsplit(".", 1)[1]
        yield anchor(f"{service}.{method.name}")
        yield f"#### {name}.{method.name}"
        yield ""
        kind = {
            (False, False): "unary",
            (False, True): "server streaming",
            (True, False): "client streaming",
            (True, True): "bidirectional streaming",
        }[(method.client_streaming, method.server_streaming)]
        yield f"- method: `/{service}/{method.name}` ({kind})"
        yield f"- request: {self.streamed(method.input_type, method.client_streaming)}"
        yield f"- response: {self.streamed(method.output_type, method.server_streaming)}"
        yield ""
        if text:
            yield inline(text)
            yield ""

    def message(self, msg: Message) -> Iterator[str]:
        comments = self.comments[msg.file]
        yield anchor(msg.full_name)
        yield f"### {short_name(msg.full_name)}"
        yield ""
        yield f"Defined in `{msg.file}`."
        yield ""
        text = comments.get(msg.path)
        if text:
            yield inline(text)
            yield ""
        for k, oneof in enumerate(msg.proto.oneof_decl):
            members = [f.name for f in msg.proto.field if f.HasField("oneof_index") and f.oneof_index == k]
            if all(f.proto3_optional for f in msg.proto.field if f.name in members):
                continue  # synthetic oneof of a proto3 optional field
            note = comments.get((*msg.path, MESSAGE_ONEOF, k))
            listed = ", ".join(f"`{m}`" for m in members)
            yield f"Oneof `{oneof.name}` holds {listed}" + (f": {inline(note)}" if note else ".")
            yield ""
        if not msg.proto.field:
            yield "No fields."
            yield ""
            return
        yield "| field | number | type | description |"
        yield "|---|---|---|---|"
        for j, field in enumerate(msg.proto.field):
            desc = inline(comments.get((*msg.path, MESSAGE_FIELD, j)), in_table=True)
            yield f"| `{field.name}` | {field.number} | {self.field_type(field, msg.proto)} | {desc} |"
        yield ""

    def enum(self, enum: Enum) -> Iterator[str]:
        comments = self.comments[enum.file]
        yield anchor(enum.full_name)
        yield f"### {short_name(enum.full_name)}"
        yield ""
        yield f"Defined in `{enum.file}`."
        yield ""
        text = comments.get(enum.path)
        if text:
            yield inline(text)
            yield ""
        yield "| value | number | description |"
        yield "|---|---|---|"
        for j, value in enumerate(enum.proto.value):
            desc = inline(comments.get((*enum.path, ENUM_VALUE, j)), in_table=True)
            yield f"| `{value.name}` | {value.number} | {desc} |"
        yield ""

    def render(self) -> str:
        lines: list[str] = [INTRO.read_text(encoding="utf-8").rstrip("\n"), ""]
        lines += self.contents()
        lines += self.services()
        lines += ["## Messages", ""]
        for msg in self.messages:
            lines += self.message(msg)
        lines += ["## Enums", ""]
        for enum in self.enums:
            lines += self.enum(enum)
        return "\n".join(lines).rstrip("\n") + "\n"


def proto_files() -> list[str]:
    """The .proto files, relative to protos/ (how protoc names them), sorted."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """Compile the protos with grpc_tools.protoc into a FileDescriptorSet with comments."""
    with tempfile.TemporaryDirectory(prefix="motor-apidoc-") as tmp:
        out = Path(tmp) / "api.binpb"
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--include_source_info",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *proto_files(),
        ]
        done = subprocess.run(cmd, cwd=PROTO_ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
            raise RuntimeError(f"grpc_tools.protoc failed (run with the repository's .venv python): {detail}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def render() -> str:
    """The Markdown docs/api.md should hold."""
    return Api(descriptor_set()).render()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render docs/api.md from the motor.v1 protos.")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is out of date")
    args = parser.parse_args(argv)
    try:
        text = render()
    except RuntimeError as exc:
        print(f"apidoc: {exc}", file=sys.stderr)
        return 2
    rel = OUTPUT.relative_to(ROOT)
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
        if current != text:
            print(f"{rel} is out of date with protos/: run `make docs`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
