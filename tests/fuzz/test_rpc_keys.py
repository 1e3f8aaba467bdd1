"""The management key (``x-motor-management-key``) fuzzed: whatever a caller presents, every
motor.v1 RPC answers UNAUTHENTICATED (no key) or PERMISSION_DENIED (a wrong one) before the
request is even parsed, and the right key lets the call through to its usual answer. Health and
reflection never need it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc._cython import cygrpc
from hypothesis import given
from hypothesis import strategies as st

from motor_mesh.common.interceptors import KEY_METADATA
from tests.coordinator.conftest import StartCoordinator
from tests.fuzz.harness import SERVICES, fuzz, serving

KEY = "s3cr3t-management-key"
COORDINATOR = SERVICES["motor.v1.Coordinator"]


@pytest.fixture
async def keyed(start_coordinator: StartCoordinator, tmp_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    coord = await start_coordinator(management_key_file=str(path))
    yield coord.channel


presented = st.one_of(
    st.none(),
    st.sampled_from(["", " ", KEY + " ", KEY.upper(), KEY[:-1], KEY + "\n", "x" * 4000, KEY * 2]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
)


@fuzz(60)
@given(
    method=st.sampled_from([m.name for m in COORDINATOR.methods]), key=presented, body=st.binary(max_size=40)
)
async def test_any_key_any_method(keyed: grpc.aio.Channel, method: str, key: str | None, body: bytes) -> None:
    m = COORDINATOR.methods_by_name[method]
    metadata = () if key is None else ((KEY_METADATA, key),)
    out = None
    # Metadata the client library itself refuses to send (a newline, say) never reaches the server.
    with contextlib.suppress(ValueError, cygrpc.ExecuteBatchError):
        out = await _call_with(keyed, m, body, metadata)
    if out is None:
        return
    if key is None:
        assert out == grpc.StatusCode.UNAUTHENTICATED
    elif key != KEY:
        assert out == grpc.StatusCode.PERMISSION_DENIED, (key, out)
    else:
        assert out not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    assert await serving(keyed, COORDINATOR.full_name)  # health needs no key


async def _call_with(
    channel: grpc.aio.Channel, method: MethodDescriptor, body: bytes, metadata: tuple[tuple[str, Any], ...]
) -> grpc.StatusCode:
    assert not (method.server_streaming or method.client_streaming)  # the Coordinator's are unary
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        await channel.unary_unary(path, request_serializer=None, response_deserializer=None)(
            body, timeout=5, metadata=metadata
        )
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("key", [b"\xff\x00binary", b""])
async def test_binary_metadata_named_like_the_key(keyed: grpc.aio.Channel, key: bytes) -> None:
    m = COORDINATOR.methods_by_name["ListInstances"]
    code = await _call_with(keyed, m, b"", ((KEY_METADATA + "-bin", key),))
    assert code == grpc.StatusCode.UNAUTHENTICATED
