"""A hand-built cluster for ``motor top``'s tests: what a Coordinator's GetEngineMetrics answers
for it (the INSTANCE and ROLE views, aggregated as the contract says: gauges summed, KV usage
averaged with a _max beside it, histograms merged bucket-wise, counters summed), and a fake
Coordinator serving only that RPC over gRPC."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from motor_mesh.common import enums, errors
from motor_mesh.common.rpc import service_handler
from motor_mesh.gen.motor.v1 import coordinator_pb2

COORDINATOR = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
# vLLM's bucket bounds (a subset), +Inf last.
TTFT_BOUNDS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)
TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, math.inf)
HISTOGRAM = coordinator_pb2.METRIC_TYPE_HISTOGRAM
GAUGE = coordinator_pb2.METRIC_TYPE_GAUGE
COUNTER = coordinator_pb2.METRIC_TYPE_COUNTER
T0 = 1_800_000_000.0


def le_text(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(bound)


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


class Families:
    """Samples gathered into MetricFamily messages, sorted by family name."""

    def __init__(self) -> None:
        self._by_name: dict[str, coordinator_pb2.MetricFamily] = {}

    def add(
        self,
        family: str,
        kind: coordinator_pb2.MetricType.ValueType,
        sample: str,
        labels: dict[str, str],
        value: float,
    ) -> None:
        f = self._by_name.setdefault(family, coordinator_pb2.MetricFamily(name=family, type=kind))
        f.samples.append(coordinator_pb2.MetricSample(name=sample, labels=labels, value=value))

    def histogram(
        self, name: str, labels: dict[str, str], observed: list[float], bounds: Iterable[float]
    ) -> None:
        for b in bounds:
            self.add(
                name, HISTOGRAM, f"{name}_bucket", {**labels, "le": le_text(b)}, sum(o <= b for o in observed)
            )
        self.add(name, HISTOGRAM, f"{name}_count", labels, len(observed))
        self.add(name, HISTOGRAM, f"{name}_sum", labels, math.fsum(observed))

    def messages(self) -> list[coordinator_pb2.MetricFamily]:
        return [self._by_name[k] for k in sorted(self._by_name)]


@dataclass
class Instance:
    """One instance's engines, and what they have counted since they started."""

    id: int
    role: str
    engine: str = "vllm"  # or "sglang"
    dp: int = 1
    running: float = 0
    waiting: float = 0
    kv: list[float] = field(default_factory=list)  # per engine, 0..1
    prompt_tokens: float = 0
    generation_tokens: float = 0
    prompt_tps: float = 0
    generation_tps: float = 0
    ttft: list[float] = field(default_factory=list)  # observations, seconds
    tpot: list[float] = field(default_factory=list)
    stale_ranks: set[int] = field(default_factory=set)
    has_data: bool = True  # False: scraped, but no scrape has succeeded yet

    def scrapes(self, port: int) -> list[coordinator_pb2.EngineScrape]:
        found = []
        for rank in range(self.dp):
            e = coordinator_pb2.EngineScrape(
                instance_id=self.id,
                role=enums.ROLES_BY_NAME[self.role],
                host="127.0.0.1",
                port=port + rank,
                dp_rank=rank,
                fresh=self.has_data and rank not in self.stale_ranks,
            )
            if self.has_data:
                e.last_success_time.CopyFrom(timestamp(T0))
            if not e.fresh:
                e.error = "connection refused"
            found.append(e)
        return found


def merged(role: str, instances: list[Instance]) -> Instance:
    """A role's instances as one (what the ROLE view aggregates them to)."""
    return Instance(
        id=0,
        role=role,
        engine=instances[0].engine,
        running=sum(i.running for i in instances),
        waiting=sum(i.waiting for i in instances),
        kv=[k for i in instances for k in i.kv],
        prompt_tokens=sum(i.prompt_tokens for i in instances),
        generation_tokens=sum(i.generation_tokens for i in instances),
        prompt_tps=sum(i.prompt_tps for i in instances),
        generation_tps=sum(i.generation_tps for i in instances),
        ttft=[o for i in instances for o in i.ttft],
        tpot=[o for i in instances for o in i.tpot],
    )


def add_series(fams: Families, i: Instance, labels: dict[str, str]) -> None:
    labels = {**labels, "model_name": "motor-sim"}
    if i.engine == "vllm":
        fams.add("vllm:num_requests_running", GAUGE, "vllm:num_requests_running", labels, i.running)
        fams.add("vllm:num_requests_waiting", GAUGE, "vllm:num_requests_waiting", labels, i.waiting)
        if i.kv:
            fams.add(
                "vllm:kv_cache_usage_perc", GAUGE, "vllm:kv_cache_usage_perc", labels, sum(i.kv) / len(i.kv)
            )
            fams.add("vllm:kv_cache_usage_perc_max", GAUGE, "vllm:kv_cache_usage_perc_max", labels, max(i.kv))
        fams.add("vllm:prompt_tokens", COUNTER, "vllm:prompt_tokens_total", labels, i.prompt_tokens)
        fams.add(
            "vllm:generation_tokens", COUNTER, "vllm:generation_tokens_total", labels, i.generation_tokens
        )
        fams.histogram("vllm:time_to_first_token_seconds", labels, i.ttft, TTFT_BOUNDS)
        fams.histogram("vllm:time_per_output_token_seconds", labels, i.tpot, TPOT_BOUNDS)
    else:
        fams.add("sglang:num_running_reqs", GAUGE, "sglang:num_running_reqs", labels, i.running)
        fams.add("sglang:num_queue_reqs", GAUGE, "sglang:num_queue_reqs", labels, i.waiting)
        if i.kv:
            fams.add("sglang:token_usage", GAUGE, "sglang:token_usage", labels, sum(i.kv) / len(i.kv))
            fams.add("sglang:token_usage_max", GAUGE, "sglang:token_usage_max", labels, max(i.kv))
        fams.add("sglang:prompt_tokens", COUNTER, "sglang:prompt_tokens_total", labels, i.prompt_tokens)
        fams.add(
            "sglang:generation_tokens", COUNTER, "sglang:generation_tokens_total", labels, i.generation_tokens
        )
        fams.histogram("sglang:time_to_first_token_seconds", labels, i.ttft, TTFT_BOUNDS)
        fams.histogram("sglang:inter_token_latency_seconds", labels, i.tpot, TPOT_BOUNDS)
    fams.add("motor:prompt_tokens_per_second", GAUGE, "motor:prompt_tokens_per_second", labels, i.prompt_tps)
    fams.add(
        "motor:generation_tokens_per_second",
        GAUGE,
        "motor:generation_tokens_per_second",
        labels,
        i.generation_tps,
    )


@dataclass
class Cluster:
    """The engines a Coordinator scrapes, and its own migrations counter."""

    instances: list[Instance]
    collect_time: float | None = T0
    migrations: dict[tuple[str, str], float] = field(default_factory=dict)  # (reason, outcome) -> count

    def response(
        self, request: coordinator_pb2.GetEngineMetricsRequest
    ) -> coordinator_pb2.GetEngineMetricsResponse:
        fams = Families()
        with_data = [i for i in self.instances if i.has_data]
        if request.view == coordinator_pb2.ENGINE_METRICS_VIEW_INSTANCE:
            for i in with_data:
                add_series(fams, i, {"instance_id": str(i.id), "role": i.role})
        elif request.view == coordinator_pb2.ENGINE_METRICS_VIEW_ROLE:
            for role in ("prefill", "decode", "union"):
                mine = [i for i in with_data if i.role == role]
                if mine:
                    add_series(fams, merged(role, mine), {"role": role})
            workers = {
                r: sum(
                    1 for i in with_data for rank in range(i.dp) if i.role == r and rank not in i.stale_ranks
                )
                for r in ("prefill", "decode")
            }
            for r, active in workers.items():
                name = f"motor:active_{r}_workers"
                fams.add(name, GAUGE, name, {}, active)
        else:
            raise errors.bad_request([("view", "this fake serves INSTANCE and ROLE only")])
        resp = coordinator_pb2.GetEngineMetricsResponse(families=fams.messages())
        port = 10000
        for inst in sorted(self.instances, key=lambda i: i.id):
            resp.engines.extend(inst.scrapes(port))
            port += 10
        if self.collect_time is not None:
            resp.collect_time.CopyFrom(timestamp(self.collect_time))
        if request.include_coordinator:
            own = Families()
            for (reason, outcome), n in sorted(self.migrations.items()):
                own.add(
                    "motor_coordinator_migrations",
                    COUNTER,
                    "motor_coordinator_migrations_total",
                    {"reason": reason, "outcome": outcome},
                    n,
                )
            own.add("motor_coordinator_routable", GAUGE, "motor_coordinator_routable", {}, 1)
            resp.coordinator_families.extend(own.messages())
        return resp


def realistic() -> Cluster:
    """A prefill instance (vLLM), a decode instance with two DP engines (one of them stale), and
    a decode instance whose engine has not been scraped yet."""
    return Cluster(
        instances=[
            Instance(
                id=1,
                role="prefill",
                running=2,
                waiting=1,
                kv=[0.25],
                prompt_tokens=12000,
                generation_tokens=0,
                prompt_tps=1500,
                ttft=[0.05] * 40 + [0.09] * 9 + [0.3],
            ),
            Instance(
                id=2,
                role="decode",
                dp=2,
                running=7,
                waiting=0,
                kv=[0.5, 0.75],
                prompt_tokens=0,
                generation_tokens=64000,
                generation_tps=800,
                ttft=[0.07] * 50,
                tpot=[0.02] * 90 + [0.06] * 10,
                stale_ranks={1},
            ),
            Instance(id=3, role="decode", has_data=False),
        ],
        migrations={("disconnect", "continued"): 2, ("drain", "completed"): 1, ("timeout", "refused"): 0},
    )


class FakeCoordinator:
    """Serves GetEngineMetrics from ``cluster`` (or fails it with ``fail``: a MotorError);
    every other RPC is UNIMPLEMENTED."""

    VALIDATORS: dict[str, Any] = {}

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.fail: errors.MotorError | None = None
        self.requests: list[coordinator_pb2.GetEngineMetricsRequest] = []

    async def GetEngineMetrics(self, request: coordinator_pb2.GetEngineMetricsRequest, context: Any) -> Any:
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        return self.cluster.response(request)

    def __getattr__(self, name: str) -> Any:
        async def unimplemented(request: Any, context: Any) -> Any:
            raise errors.unimplemented(name)

        return unimplemented


class FakeCoordinatorServer:
    def __init__(self, fake: FakeCoordinator) -> None:
        self.fake = fake
        self.port = 0
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeCoordinatorServer:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((service_handler(COORDINATOR, self.fake),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
