"""Client channels between mesh services.

Every channel gets the client keepalive settings (docs/architecture.md, "Runtime rules"),
message-size limits, a retry policy for idempotent unary RPCs, and an interceptor that gives
every unary call a deadline (5 s unless the caller sets one), ``wait_for_ready`` (a peer that is
restarting is waited for, up to the deadline) and the management key when one is configured.

TLS: a client uses it whenever its side of the deployment does (:class:`ClientTLS`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from motor_mesh.common import log, telemetry
from motor_mesh.common.config import ServerConfig
from motor_mesh.common.interceptors import KEY_METADATA

DEFAULT_TIMEOUT_S = 5.0

# Safe to repeat: reads, and instance-set writes whose repeat is a no-op (Set, Add of the same
# identity, Pause, Resume). Delete and Register are not: a retried success answers differently.
_IDEMPOTENT = {
    "motor.v1.Controller": ["ListInstances", "ListAlarms", "GetFaultToleranceStatus"],
    "motor.v1.Coordinator": [
        "SetInstances",
        "AddInstances",
        "PauseInstances",
        "ResumeInstances",
        "ListInstances",
    ],
    "motor.v1.NodeManager": ["GetStatus", "Pause", "Resume"],
    "grpc.health.v1.Health": ["Check"],
}

SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": s, "method": m} for s, ms in _IDEMPOTENT.items() for m in ms],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def channel_options(max_message_bytes: int = 4 * 1024 * 1024) -> list[tuple[str, Any]]:
    return [
        ("grpc.keepalive_time_ms", 20000),
        ("grpc.keepalive_timeout_ms", 10000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", SERVICE_CONFIG),
        # Reconnect quickly to a restarted peer instead of the default 20 s+ backoff ceiling.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        # Each channel owns its connections. With gRPC's global pool a channel opened to get
        # past a dead connection (a restarted Coordinator or NodeManager) would share the old
        # channel's subchannel and wait out its reconnect backoff: up to 2 s of blindness.
        ("grpc.use_local_subchannel_pool", 1),
    ]


@dataclass(frozen=True)
class ClientTLS:
    """TLS on a channel: the peer is verified with ``ca_file``, or with the system's trusted
    roots when it is ""; ``cert_file`` and ``key_file`` are presented when both are given (mTLS).
    For callers without a config section (the CLI); services pass their section instead."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def of(cls, cfg: ServerConfig) -> ClientTLS | None:
        """The TLS a service's clients use: on when its section has a CA file or a certificate.
        A certificate alone means the deployment runs TLS, so talking plaintext to peers would
        fail (or, worse, succeed against an impostor)."""
        if not (cfg.tls_ca_file or cfg.tls_cert_file):
            return None
        return cls(cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file)


# Credentials by the files they were made from. Channels are opened all the time (one per
# NodeManager, reopened after failures) and reading PEM files for each would block the event loop
# for nothing: a new channel costs one stat() per file, and the files are read again only when
# one changed (its mtime or size: a rotated certificate is picked up by the next channel, no
# restart needed). A file that cannot be read any more keeps the material last read from it.
_Identity = tuple[int, int] | None
_Paths = tuple[str, str, str]


@dataclass
class _Loaded:
    identity: tuple[_Identity, ...]
    creds: grpc.ChannelCredentials
    stale: bool = False  # a file changed or vanished and could not be read: warned once


_CREDENTIALS: OrderedDict[_Paths, _Loaded] = OrderedDict()
_CREDENTIALS_KEPT = 16


def _identity(path: str) -> _Identity:
    if not path:
        return None
    info = os.stat(path)
    return (info.st_mtime_ns, info.st_size)


def _read_file(path: str) -> bytes:
    return Path(path).read_bytes()


def _credentials(tls: ClientTLS) -> grpc.ChannelCredentials:
    mine = bool(tls.cert_file and tls.key_file)
    paths: _Paths = (tls.ca_file, tls.cert_file if mine else "", tls.key_file if mine else "")
    loaded = _CREDENTIALS.get(paths)
    if loaded is not None:
        _CREDENTIALS.move_to_end(paths)
    try:
        ident = tuple(_identity(p) for p in paths)
        if loaded is not None and loaded.identity == ident:
            loaded.stale = False
            return loaded.creds
        ca, cert, key = (_read_file(p) if p else None for p in paths)
    except OSError as exc:
        if loaded is None:
            raise
        # Mid-rotation (a file replaced by remove + write) or removed: the material we have still
        # makes the same connections it made a moment ago.
        if not loaded.stale:
            loaded.stale = True
            files = [p for p in paths if p]
            log.warn("tls_files_unreadable", files=files, reason=str(exc), using="the files as last read")
        return loaded.creds
    # root_certificates=None: gRPC's default roots (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH overrides them).
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    _CREDENTIALS[paths] = _Loaded(ident, creds)
    while len(_CREDENTIALS) > _CREDENTIALS_KEPT:
        _CREDENTIALS.popitem(last=False)
    return creds


class _CallDetails(grpc.aio.ClientCallDetails):
    pass


def _with_defaults(details: grpc.aio.ClientCallDetails, key: str | None, unary: bool) -> _CallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    if key is not None:
        metadata.add(KEY_METADATA, key)
    timeout = details.timeout
    if unary and timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    wait = details.wait_for_ready
    if wait is None:
        wait = True
    return _CallDetails(details.method, timeout, metadata, details.credentials, wait)


class _UnaryDefaults(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: str | None) -> None:
        self._key = key

    async def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return await continuation(_with_defaults(details, self._key, unary=True), request)


class _UnaryStreamDefaults(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: str | None) -> None:
        self._key = key

    async def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return await continuation(_with_defaults(details, self._key, unary=False), request)


class _StreamStreamDefaults(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, key: str | None) -> None:
        self._key = key

    async def intercept_stream_stream(self, continuation: Callable, details: Any, iterator: Any) -> Any:
        return await continuation(_with_defaults(details, self._key, unary=False), iterator)


def open_channel(
    target: str,
    *,
    key: str | None = None,
    tls: ServerConfig | ClientTLS | None = None,
    max_message_bytes: int = 4 * 1024 * 1024,
    service: str = "client",
    retries: bool = True,
) -> grpc.aio.Channel:
    """A channel to ``target`` ("host:port"). ``tls`` is the caller's own config section (TLS
    when it has ``tls_ca_file`` or ``tls_cert_file``, see :meth:`ClientTLS.of`) or a
    :class:`ClientTLS`; ``None`` is plaintext.
    ``retries=False``: idempotent calls are not retried on UNAVAILABLE (a probe that must say
    "gone" at once rather than after the retry backoff)."""
    interceptors: list[Any] = [_UnaryDefaults(key), _UnaryStreamDefaults(key), _StreamStreamDefaults(key)]
    interceptors += telemetry.client_interceptors(service)
    options = channel_options(max_message_bytes)
    if not retries:
        options = [o for o in options if o[0] != "grpc.service_config"] + [("grpc.enable_retries", 0)]
        options = [o for o in options if o != ("grpc.enable_retries", 1)]
    client_tls = ClientTLS.of(tls) if isinstance(tls, ServerConfig) else tls
    if client_tls is not None:
        creds = _credentials(client_tls)
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
