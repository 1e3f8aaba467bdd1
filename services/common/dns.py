"""``dns:///name:port`` targets: a name standing for every address it resolves to.

A Kubernetes headless Service names one address per pod, so a client given the Service's name
follows the pods as they come and go without its configuration changing.
"""

from __future__ import annotations

import asyncio
import socket

DNS_PREFIX = "dns:///"
# getaddrinfo's answers that mean "no such name" rather than "could not ask".
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def split_entry(entry: str) -> tuple[str, int] | None:
    """(name, port) of a ``dns:///name:port`` entry; None for a plain address."""
    if not entry.startswith(DNS_PREFIX):
        return None
    name, _, port = entry[len(DNS_PREFIX) :].rpartition(":")
    return name, int(port)


def join(host: str, port: int) -> str:
    # Only an IPv6 address has a colon; it needs brackets before the port.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(name: str, port: int) -> list[str]:
    """Every TCP address of ``name``, sorted; [] when the name does not exist. Raises OSError
    when the lookup itself failed."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NO_SUCH_NAME:
            return []
        raise
    return sorted({join(str(info[4][0]), port) for info in infos})
