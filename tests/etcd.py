"""A real single-member etcd for the tests (Debian's etcd-server: ``make system-deps``), and
``etcdctl`` to look at it independently of Motor's own client.

``EtcdServer(data_dir).start()`` runs ``/usr/bin/etcd`` on two reserved loopback ports (client
and peer) and returns once it answers (with ``pki``, a directory holding ``ca.pem``,
``server.pem``/``server.key`` and ``client.pem``/``client.key``, it serves TLS and requires client
certificates); ``stop()`` (SIGTERM, then SIGKILL) and ``start()`` again
bring it back on the same ports with the same data. The ``etcd_server`` fixture gives a started
one and stops it at teardown; import it into a conftest.py to use it. Without etcd installed
the test skips with one line.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.poll import wait_until
from tests.ports import reserved_port
from tests.procs import Proc, system_binary

NOT_INSTALLED = "etcd not installed (make system-deps installs Debian etcd-server)"


class EtcdServer:
    def __init__(self, data_dir: Path, pki: Path | None = None) -> None:
        binary = system_binary("etcd")
        if binary is None:
            pytest.skip(NOT_INSTALLED)
        self.binary = binary
        self.data_dir = data_dir
        self.pki = pki
        self.client_port = reserved_port()
        self.peer_port = reserved_port()
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "http" if self.pki is None else "https"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "etcd is not running"
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start etcd (again: same ports, same data) and wait until it answers."""
        assert self.proc is None or not self.proc.alive(), "etcd is running already"
        client, peer = f"{self.scheme}://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.pki is not None:
            tls = [f"--cert-file={self.pki / 'server.pem'}", f"--key-file={self.pki / 'server.key'}"]
            tls += [f"--trusted-ca-file={self.pki / 'ca.pem'}", "--client-cert-auth"]
        self.proc = Proc(
            [
                self.binary,
                "--name=motor-test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=motor-test={peer}",
                *tls,
            ]
        )
        # Refused, reset or timed out (urllib's errors are all OSErrors) until it serves.
        wait_until(
            self._healthy, timeout, f"etcd answering on {self.endpoint} (pid {self.pid})", retry=(OSError,)
        )
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None and self.proc.alive(), f"etcd exited:\n{self.proc and self.proc.tail()}"
        # /health answers true once the member has a leader and serves requests.
        context = None
        if self.pki is not None:
            context = ssl.create_default_context(cafile=self.pki / "ca.pem")
            context.load_cert_chain(self.pki / "client.pem", self.pki / "client.key")
        with urllib.request.urlopen(
            f"{self.scheme}://{self.endpoint}/health", timeout=1, context=context
        ) as resp:
            return json.loads(resp.read()).get("health") == "true"

    def stop(self) -> None:
        """SIGTERM, and SIGKILL for whatever is left after 10 s."""
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()


def etcdctl(endpoint: str, *args: str, timeout: float = 20.0) -> str:
    """``etcdctl --endpoints=ENDPOINT ARGS`` (v3 API); its stdout. Fails the test on an error."""
    binary = system_binary("etcdctl")
    if binary is None:
        pytest.skip("etcdctl not installed (make system-deps installs Debian etcd-client)")
    done = subprocess.run(
        [binary, f"--endpoints={endpoint}", *args],
        env={**os.environ, "ETCDCTL_API": "3"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"etcdctl {' '.join(args)}: rc={done.returncode}\n{done.stderr}"
    return done.stdout
