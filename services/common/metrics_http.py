"""``GET /metrics`` for the services whose own port speaks gRPC (the Controller, each NodeManager).

A small aiohttp server on ``<host>:<metrics_port>`` renders one ``CollectorRegistry`` in the
Prometheus text format; any other path or method answers 404. It is plain HTTP even when the
service's gRPC port serves TLS, and asks for no key: the numbers name no secret, and a scraper
(Prometheus, a Kubernetes annotation) would otherwise need the service's client certificate.
The registry's collectors read the service's live objects at scrape time, on the event loop,
so nothing runs between scrapes.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from motor_mesh.common import log

PATH = "/metrics"
# In-flight scrapes get this long to finish when the service stops.
STOP_GRACE_S = 1.0


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.host = host
        self.port = port
        self._registry = registry
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; an OSError naming the address when the port cannot be bound."""
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=STOP_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                f"cannot bind metrics HTTP {self.address}: address in use or not available"
            ) from exc
        self._runner = runner

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path != PATH or request.method not in ("GET", "HEAD"):
            return web.Response(status=404, text="not found: the only path is GET /metrics\n")
        try:
            body = generate_latest(self._registry)
        except Exception:  # a collector's bug: said once per scrape, the service goes on
            log.exception("metrics_failed")
            return web.Response(status=500, text="metrics failed; see the service's log\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
