"""Start-up warnings for listeners that other machines can reach with nothing guarding them.

Loopback is the default and needs no guard. Any other bind address (``0.0.0.0``, ``::``, a host
name, a routable IP) is treated as reachable by the network, since which interfaces a name
resolves to cannot be known here. Each warning is one line, logged once per listener.
"""

from __future__ import annotations

import ipaddress

from motor_mesh.common import log
from motor_mesh.common.config import CoordinatorConfig, ServerConfig


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (also as an IPv4-mapped IPv6 address)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def serves_tls(cfg: ServerConfig) -> bool:
    return bool(cfg.tls_cert_file and cfg.tls_key_file)


def requires_client_certs(cfg: ServerConfig) -> bool:
    return serves_tls(cfg) and bool(cfg.tls_ca_file)


def check_management(service: str, cfg: ServerConfig, address: str) -> None:
    """Warn when a reachable gRPC port takes management calls from anyone, or takes the
    management key in clear text (anyone on the path can read it and replay it)."""
    if is_loopback(cfg.host) or requires_client_certs(cfg):
        return
    if not cfg.management_key_file:
        log.warn(
            "management_plane_exposed",
            service=service,
            address=address,
            detail="no management_key_file and no mTLS: "
            "anyone who can reach this port can change the cluster",
        )
    elif not serves_tls(cfg):
        log.warn(
            "management_key_in_clear",
            service=service,
            address=address,
            detail="management key over plaintext gRPC: it crosses the network unencrypted; "
            "set tls_cert_file and tls_key_file",
        )


def check_inference(cfg: CoordinatorConfig, address: str) -> None:
    """Warn when a reachable inference port serves anyone, or takes API keys in clear text."""
    if is_loopback(cfg.host):
        return
    if not cfg.api_keys_file:
        log.warn(
            "inference_api_open",
            service="coordinator",
            address=address,
            detail="no api_keys_file: anyone who can reach this port can send requests",
        )
    elif not serves_tls(cfg):
        log.warn(
            "api_keys_in_clear",
            service="coordinator",
            address=address,
            detail="api_keys_file over plain HTTP: Bearer keys cross the network unencrypted; "
            "set tls_cert_file and tls_key_file",
        )
