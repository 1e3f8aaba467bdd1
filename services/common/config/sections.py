"""The configuration schema as typed sections: one frozen dataclass per section, one field per key.

Each field carries its default and its check (:mod:`.checks`); the string literal under a field
is its documentation, which ``docs/configuration.md`` is generated from. The loader validates
the plain JSON values first, then builds these objects, so code reads ``cfg.port`` and mypy sees
every key; a typo is a type error, not a runtime KeyError.

JSON lists become tuples and JSON objects read-only mappings, so a section can be shared freely.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import itertools
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from motor_mesh.common.config import checks as c


def setting(default: Any, check: c.Check, *, typed: Callable[[Any], Any] | None = None) -> Any:
    """A key: its default (in its typed form), its check and, when it is not the plain JSON
    shape, how to build the typed value from the checked JSON value."""
    meta = {"check": check, "typed": typed}
    if isinstance(default, Mapping):
        frozen = MappingProxyType(dict(default))
        return field(default_factory=lambda: frozen, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Parallel:
    """How one instance is split: data, tensor, pipeline and expert parallel sizes, and the
    number of nodes it spans."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    nnodes: int = 1

    @classmethod
    def from_json(cls, value: Mapping[str, int]) -> Parallel:
        return cls(**{k: int(value.get(k, 1)) for k in c.PARALLEL_KEYS})


ONE_OF_EACH = Parallel()


@dataclass(frozen=True)
class RateLimit:
    """The Coordinator-wide rate limits (all tenants together), as token buckets that refill
    continuously: `max_requests` and `max_tokens_per_window` per `window_s`."""

    max_requests: int = 0
    window_s: float = 60
    max_tokens_per_window: int = 0
    skip_paths: tuple[str, ...] = ("/health", "/readiness", "/metrics", "/metrics/engines")

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> RateLimit:
        base = cls()
        return cls(
            max_requests=int(value.get("max_requests", base.max_requests)),
            window_s=value.get("window_s", base.window_s),
            max_tokens_per_window=int(value.get("max_tokens_per_window", base.max_tokens_per_window)),
            skip_paths=tuple(value.get("skip_paths", base.skip_paths)),
        )


NO_RATE_LIMIT = RateLimit()


@dataclass(frozen=True)
class Planner:
    """The Controller's planner (docs/planner.md): it moves instances between prefill and
    decode to keep the p90 latency targets, or recommends it."""

    mode: str = "off"  # off | recommend | act
    interval_s: float = 30
    ttft_p90_ms: float = 1000
    itl_p90_ms: float = 50
    min_prefill: int = 1
    min_decode: int = 1
    cooldown_s: float = 300
    min_gain: float = 0.1
    max_switches: int = 1
    max_instances: int = 0

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Planner:
        base = dataclasses.asdict(cls())
        base.update(value)
        return cls(**base)


PLANNER_OFF = Planner()


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Keys every section has: how the service's listeners bind and authenticate, and its log
    format. (The engine section accepts them too, so every section reads the same way.)"""

    host: str = setting("127.0.0.1", c.HOST)
    """Address the service's listeners bind to (a NodeManager also registers with it, so the
    Controller must reach it there). The default keeps every port reachable from this machine
    only. Any address outside 127.0.0.0/8 and ::1 (`0.0.0.0`, `::`, a host name, a routable IP)
    counts as reachable from the network, and an unguarded port is warned about once at start:
    `management_plane_exposed` for a gRPC port with neither `management_key_file` nor mTLS;
    on the Coordinator, `inference_api_open` for an HTTP port without `api_keys_file`, and
    `api_keys_in_clear` for API keys on a port that is not HTTPS."""
    management_key_file: str = setting("", c.FILE)
    """File holding the management key. When set, every motor.v1 RPC must carry it in the
    `x-motor-management-key` metadata (health and reflection never need it). The file must be a
    regular file that group and others cannot access (`chmod 600`), or the service refuses to
    start."""
    tls_cert_file: str = setting("", c.FILE)
    """PEM certificate the service presents. With `tls_key_file` it serves TLS on its gRPC port,
    and the Coordinator serves HTTPS on its inference port as well. When set, this service's
    own calls to its peers use TLS too (the deployment runs TLS), verifying them with
    `tls_ca_file` or, without it, the system's trusted roots; with `tls_key_file` they present
    this certificate (mTLS)."""
    tls_key_file: str = setting("", c.FILE)
    """PEM private key of `tls_cert_file`. It must be a regular file that group and others cannot
    access (`chmod 600`), or the service refuses to start."""
    tls_ca_file: str = setting("", c.FILE)
    """PEM CA bundle. On a gRPC server (with `tls_cert_file` and `tls_key_file`) it requires
    client certificates signed by this CA (mTLS); the Coordinator's HTTPS port never asks for
    one, since OpenAI clients carry none. On this service's clients it turns TLS on and
    verifies the peer's certificate with this CA."""
    max_message_bytes: int = setting(4194304, c.integer(1024, 2**31 - 1))  # gRPC takes a C int
    """Largest gRPC message accepted or sent; a larger request is refused with
    RESOURCE_EXHAUSTED."""
    log_format: str = setting("kv", c.choice("kv", "json"))
    """One line per event on stderr: `kv` (`event=listening service=controller …`) or `json`."""
    log_level: str = setting("info", c.LOG_LEVEL)
    """Least severe event logged: `debug`, `info`, `warning` or `error`. Changes while the
    service runs (`motor config reload`, SIGHUP)."""


@dataclass(frozen=True, kw_only=True)
class ControllerConfig(ServerConfig):
    """The Controller: assembly, heartbeats, the instance state machine, persistence and the
    push of the instance set to the Coordinators."""

    port: int = setting(7100, c.PORT)
    """gRPC port of motor.v1.Controller (0: any free port, logged in `event=listening`)."""
    coordinators: tuple[str, ...] = setting(("127.0.0.1:7200",), c.array(c.COORDINATOR))
    """The Coordinators whose instance table this Controller keeps equal to its ACTIVE and PAUSED
    instances: `host:port` for one, `dns:///name:port` for every address `name` resolves to,
    looked up again every 5 s (a Kubernetes headless Service over a Coordinator Deployment)."""
    state_dir: str = setting(".motor/controller", c.DIRECTORY)
    """Directory of the embedded database (`controller.db`) and its lock: instance ids,
    instances and pending assemblies survive a restart. One Controller per directory."""
    heartbeat_interval_s: float = setting(3, c.DURATION)
    """How often each NodeManager sends a beat (told to it when it registers)."""
    instance_heartbeat_timeout_s: float = setting(10, c.DURATION)
    """An instance is DELETED when one of its NodeManagers has been silent this long (a broken
    stream starts the clock at once; after a Controller restart every clock starts at load)."""
    instance_assemble_timeout_s: float = setting(600, c.DURATION)
    """A pending instance that has not completed this long after its last registration is
    dropped; its NodeManagers must register again."""
    start_command_retries: int = setting(3, c.integer(0, 100))
    """Retries of a failed StartEngines to one NodeManager (with backoff) before the instance is
    dropped. A NodeManager answering NODE_MISMATCH is not retried."""
    coordinator_set_sync_interval_s: float = setting(300, c.DURATION)
    """Period of the full SetInstances sent to every Coordinator, on top of the incremental
    calls, so a Coordinator can never drift for longer than this."""
    enable_engine_relaunch: bool = setting(True, c.BOOLEAN)
    """Relaunch dead engines in place (every NodeManager of the instance together) instead of
    restarting their pods; off: NodeManagers hold nothing and their pod-restart fallback acts."""
    # The ranges of the four relaunch keys are those the relaunch strategy is designed for.
    engine_relaunch_complete_timeout_s: float = setting(600, c.seconds(60, 3600))
    """How long a relaunch may take until every NodeManager reports ready."""
    engine_relaunch_poll_interval_s: float = setting(5, c.seconds(1, 60))
    """How often readiness is polled during a relaunch."""
    engine_relaunch_dispatch_retries: int = setting(3, c.integer(0, 10))
    """Retries of the reachability probe of each NodeManager before a relaunch."""
    engine_relaunch_nm_unreachable_threshold: int = setting(3, c.integer(1, 10))
    """Consecutive unreachable polls of one NodeManager after which a relaunch fails."""
    precision_auto_recovery_enabled: bool = setting(False, c.BOOLEAN)
    """When a Coordinator reports a precision alarm, terminate its prefill/decode group (decode
    first; the NodeManagers stop and their pods restart), clear the alarm and tell every
    Coordinator. Recorded at once and carried out by the Controller's reconcile, which finishes
    it across a restart or a leader change."""
    alarm_webhook_url: str = setting("", c.URL)
    """Alertmanager-compatible URL (`…/api/v2/alerts`) alarms are posted to; "" = none. An ALARM
    is a firing alert (re-sent while active), its CLEAR resolves it."""
    coordinator_key_file: str = setting("", c.FILE)
    """Management key presented to the Coordinators."""
    nodemanager_key_file: str = setting("", c.FILE)
    """Management key presented to the NodeManagers."""
    metrics_port: int = setting(0, c.PORT)
    """Port of the Prometheus `GET /metrics` endpoint (plain HTTP on `host`); 0 = off.
    `motor up` sets 9100."""
    store: str = setting("sqlite", c.STORE)
    """Where the state lives. `sqlite`: `state_dir/controller.db`, one Controller. `etcd`: under
    `etcd_prefix` in the etcd cluster at `etcd_endpoints`; several Controllers may run, one is
    elected leader (`leader_lease_s`) and the others stand by to take over."""
    etcd_endpoints: tuple[str, ...] = setting((), c.array(c.HOSTPORT))
    """etcd client addresses (`host:port`), tried in turn; required with `store = "etcd"`."""
    etcd_prefix: str = setting("/motor", c.text(r"/[^\0]*", "a key prefix starting with /"))
    """Every key this cluster's Controllers keep in etcd starts with this prefix: several Motor
    clusters can share one etcd."""
    etcd_ca_file: str = setting("", c.FILE)
    """PEM CA bundle that verifies etcd's certificate; set (or `etcd_cert_file`) for TLS to etcd."""
    etcd_cert_file: str = setting("", c.FILE)
    """PEM client certificate presented to etcd (with `etcd_key_file`: etcd's `--client-cert-auth`)."""
    etcd_key_file: str = setting("", c.FILE)
    """PEM private key of `etcd_cert_file`; must not be readable by group or others."""
    leader_lease_s: float = setting(5, c.seconds(1, 60))
    """TTL of the leader's etcd lease. A leader that cannot renew it stops acting before it
    runs out; a standby takes over once it has expired."""
    planner: Planner = setting(PLANNER_OFF, c.PLANNER, typed=Planner.from_json)
    """The planner, which keeps the latency targets by moving instances between prefill and
    decode while the cluster serves (docs/planner.md). Every `interval_s` it measures each
    role's load and p90 latency (time to first token for prefill, inter-token latency for
    decode) from the Coordinators, predicts the next interval's demand, and works out the split
    of the pool's ACTIVE instances that best meets `ttft_p90_ms` and `itl_p90_ms`. `mode`:
    `off`; `recommend` logs and exports the decision (`motor_planner_recommended_instances`)
    and changes nothing; `act` carries it out, one instance at a time (at most
    `max_switches` at once): drained, its engines relaunched in place with the other role's
    launch line. It never goes below `min_prefill` / `min_decode`, switches an instance again
    only after `cooldown_s`, only when the predicted attainment gains at least `min_gain`
    (0 to 1), and never while an instance of the pool is starting, relaunching or switching.
    `max_instances` > 0 lets the pool grow to that many instances: the planner then sets the
    desired instance counts per role (`motor_desired_instances`) instead of switching, until the
    pool is that large. Changes while the Controller runs (`motor config reload`)."""
    advertise_address: str = setting("", c.text(r"(?:\S+:\d{1,5})?", 'a "host:port" or ""'))
    """The address standbys name as the leader's (in their UNAVAILABLE answers) and clients
    connect to; "" = `host:port`. Set it where `host` is a wildcard such as `0.0.0.0`."""


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig(ServerConfig):
    """The Coordinator: the routable instance table (management gRPC) and the OpenAI-compatible
    inference server."""

    port: int = setting(7200, c.PORT)
    """gRPC port of motor.v1.Coordinator (the management plane)."""
    http_port: int = setting(8000, c.PORT)
    """HTTP port of the OpenAI-compatible API, `/health`, `/readiness` and `/metrics`; HTTPS
    when `tls_cert_file` and `tls_key_file` are set (`event=listening` then adds `https=true`)."""
    workers: int = setting(0, c.integer(0, 256))
    """Inference worker processes sharing `http_port` (`SO_REUSEPORT`); 0 = one per CPU core.
    With 1, the inference server runs in the management process; with more, each worker is its
    own process, restarted if it dies, holding a copy of the table that every management write
    reaches before it answers."""
    max_concurrent_requests: int = setting(4096, c.COUNT)
    """Completion requests served at once by this Coordinator (all workers together; each
    worker takes its share). More wait in a queue."""
    max_queued_requests: int = setting(4096, c.integer(0, 1_000_000))
    """Completion requests that may wait for a slot; past it the answer is 429 with
    `Retry-After` at once."""
    queue_timeout_s: float = setting(30, c.DURATION)
    """Longest wait in the queue; then 503 with `Retry-After`."""
    prefill_timeout_s: float = setting(300, c.DURATION)
    """Deadline of a whole prefill leg (vLLM hand-off, SGLang prefill); past it, 504."""
    decode_first_byte_timeout_s: float = setting(300, c.DURATION)
    """Deadline for the decode leg's (or a whole request's) answer to begin; past it, 504."""
    decode_idle_timeout_s: float = setting(120, c.DURATION)
    """Longest silence while an answer is being read; past it, 504 before any byte reached the
    client, or an error event ending a stream."""
    migration_limit: int = setting(3, c.integer(0, 100))
    """Times one request may continue on another instance after the engine serving it failed
    (connection lost, 5xx, `decode_idle_timeout_s`, the instance leaving the table) or was
    drained; 0 turns continuation off. The output already sent is kept: the continuation
    computes only the rest (docs/migration.md)."""
    migration_delay_s: float = setting(0.2, c.seconds(0, 60))
    """Wait before the first continuation of a request, doubled for each further one."""
    max_migration_state_bytes: int = setting(4 * 1024 * 1024, c.integer(1024, 1 << 31))
    """Most bytes of state (prompt and output so far) kept for one request to continue it;
    past it the request is served without continuation (`migration_refused: state_bytes`)."""
    max_migration_state_total_bytes: int = setting(1 << 30, c.integer(1024, 1 << 40))
    """Most continuation state kept by this Coordinator at once, all requests and workers
    together (each worker takes its share); a request that would pass it is served without
    continuation (`migration_refused: state_total_bytes`)."""
    drain_grace_s: float = setting(30, c.seconds(0, 3600))
    """How long requests on a drained instance (`DrainInstances`, `motor drain`) may finish
    where they are before they continue on another instance."""
    engine_metrics_interval_s: float = setting(3, c.seconds(0, 3600))
    """How often every engine endpoint of the table is scraped (`/metrics`) for the aggregated
    engine metrics (`/metrics/engines`, `GetEngineMetrics`, `motor top`; docs/engine-metrics.md);
    0 = never."""
    engine_metrics_stale_s: float = setting(15, c.seconds(1, 86400))
    """How long an engine whose scrapes fail keeps its last values in the aggregate."""
    max_body_bytes: int = setting(67108864, c.integer(1024, 1 << 31))
    """Largest request body accepted; larger ones are answered 413."""
    max_json_depth: int = setting(64, c.integer(1, 512))  # the JSON parsers stop near 1000
    """Deepest nesting of arrays and objects accepted in a request body; deeper ones are
    answered 400."""
    prefill_policy: str = setting("least_load", c.POLICY)
    """How a prefill instance is chosen: `least_load` (fewest in-flight tokens), `round_robin`,
    `power_of_two` (the less loaded of two random ones), or `kv_aware` (the one whose engine
    holds the longest prefix of the prompt in its KV cache, by the engines' KV cache events,
    weighed against load; see docs/kv-routing.md)."""
    decode_policy: str = setting("least_load", c.POLICY)
    """How a decode (or union) instance is chosen; same choices as `prefill_policy`."""
    kv_prefix_weight: float = setting(1.0, c.WEIGHT)
    """`kv_aware`: weight of the prompt tokens an engine would have to compute (those it has not
    cached). Each candidate costs `kv_prefix_weight * uncached + kv_load_weight * in-flight
    tokens`; the cheapest is chosen."""
    kv_load_weight: float = setting(1.0, c.WEIGHT)
    """`kv_aware`: weight of an instance's in-flight tokens (see `kv_prefix_weight`)."""
    kv_index_max_blocks: int = setting(262144, c.integer(1, 1 << 30))
    """`kv_aware`: most KV blocks remembered per engine endpoint; past it the oldest are
    forgotten first (a bound on memory should an engine's removals be lost). With inference
    workers it also bounds the table each endpoint gets in the memory they share, which grows
    with the blocks the endpoint holds: 16 to 32 bytes per block held, 4 MiB at most at the
    default."""
    kv_load_gate: float = setting(1.5, c.LOAD_GATE)
    """`kv_aware`: a candidate with more than one request in flight, and more than this many
    times the candidates' mean, is weighed by load alone, as if it cached nothing: a prefix
    every request shares cannot pile them all on the engine that cached it first. Counted per
    inference worker. 0 turns the gate off."""
    kv_affinity_load_gate_topn: int = setting(0, c.integer(0, 1_000_000))
    """`kv_aware`: only this many of the candidates with the fewest requests in flight are
    weighed for their cache; the others by load alone. 0: every candidate under
    `kv_load_gate`."""
    kv_events_stale_s: float = setting(10, c.seconds(0, 86400))
    """`kv_aware`: an engine that served prefills but published no KV event batch (and whose
    replay socket did not answer) for this long has its cached blocks treated as unknown (routed
    by load alone) until its batches flow again. 0 turns the check off."""
    pd_min_prompt_tokens: int = setting(0, c.integer(0, 1 << 30))
    """Prompts shorter than this many tokens skip the prefill leg: a decode instance computes
    their prefill itself (conditional disaggregation). 0 sends every prompt through prefill."""
    tokenizers: Mapping[str, str] = setting({}, c.PATHS_BY_NAME)
    """`kv_aware`: served model name → local tokenizer (a directory with `tokenizer.json` and
    `tokenizer_config.json`, or the file), so prompts are tokenized as the engine does. Without
    an entry the model name itself is tried as such a path; the simulated engine falls back to
    its built-in tokenizer, a vLLM or SGLang model without one is routed by load alone."""
    api_keys_file: str = setting("", c.FILE)
    """File of client API keys, one per line (`#` comments allowed). When set, the inference API
    requires `Authorization: Bearer <key>`. It must be a regular file that group and others
    cannot access (`chmod 600`), or the Coordinator refuses to start. Without HTTPS
    (`tls_cert_file`, `tls_key_file`) on a `host` other than loopback the keys travel in clear,
    which is warned about at start (`api_keys_in_clear`); without this file there,
    `inference_api_open` is."""
    tenants_file: str = setting("", c.FILE)
    """JSON file of tenants: a list of `{"name", "keys", "weight", "priority", "requests_per_minute",
    "tokens_per_minute", "max_concurrent"}` (docs/admission.md). A key authenticates its
    tenant (`Authorization: Bearer <key>`); stored as given or hashed (`sha256:…` or the PBKDF2
    form that `motor keys hash` prints). With `api_keys_file` as well, that file's keys are one
    more tenant, `default`. Same permission rule as `api_keys_file`; re-read by `motor config
    reload` and SIGHUP."""
    rate_limit: RateLimit = setting(NO_RATE_LIMIT, c.RATE_LIMIT, typed=RateLimit.from_json)
    """Limits on this Coordinator deployment as a whole (every replica and tenant together): at
    most `max_requests` requests and `max_tokens_per_window` tokens (prompt plus `max_tokens`,
    corrected by the real usage when the request ends) per `window_s`, as token buckets that
    refill continuously; 0 = no limit. Replicas split each limit evenly by the count the
    Controller pushes. Requests to `skip_paths` are never limited. A refused request gets 429
    `rate_limit_exceeded` with `Retry-After`."""
    clamp_max_tokens: bool = setting(False, c.BOOLEAN)
    """Lower a request's `max_tokens` to what the smaller of its prefill and decode engines'
    `max_model_len` leaves after the prompt, instead of the engine refusing it after the prefill
    was paid for; a prompt that alone is too long is refused with 400 before any leg."""
    congestion_raise_s: float = setting(10, c.seconds(0, 3600))
    """How long admission use (requests running and queued over `max_concurrent_requests` plus
    `max_queued_requests`) must stay at or above 85 % before the congestion alarm 0xFC001005 is
    raised at the Controller; it clears below 75 %."""
    controller: str = setting("127.0.0.1:7100", c.CONTROLLERS)
    """The Controller's address, where precision alarms and their clears are reported. With
    standby Controllers (the etcd store), every one of them, comma-separated, or
    `dns:///name:port`: reports go to whichever is leader."""
    controller_key_file: str = setting("", c.FILE)
    """Management key presented to the Controller when reporting precision alarms."""
    precision_check_enabled: bool = setting(False, c.BOOLEAN)
    """Sample the output of every prefill/decode group for precision problems (a shadow request
    off the client's path, at most one per group per `precision_interval_s`) and report an alarm
    to the Controller when a confirmed problem appears."""
    precision_interval_s: float = setting(30, c.DURATION)
    """At most one precision sample per prefill/decode group per this many seconds."""
    precision_logprobs: int = setting(5, c.integer(1, 20))  # engines cap top_logprobs at 20
    """`top_logprobs` asked of a sampled response."""
    precision_issue_threshold: int = setting(10, c.COUNT)
    """Consecutive anomalous samples before the probe question is asked."""
    precision_clear_threshold: int = setting(10, c.COUNT)
    """Consecutive normal samples that clear an active precision alarm."""
    precision_probe_question: str = setting(
        "What is the capital of France? Answer with one word.", c.NONEMPTY
    )
    """The question with a known answer sent to a suspect group."""
    precision_probe_expected: str = setting("Paris", c.NONEMPTY)
    """The answer `precision_probe_question` must get."""
    probe_max_attempts: int = setting(3, c.COUNT)
    """Attempts at the probe question before the precision alarm is raised."""
    probe_timeout_s: float = setting(600, c.DURATION)
    """Deadline of one probe question."""


@dataclass(frozen=True, kw_only=True)
class NodeManagerConfig(ServerConfig):
    """A NodeManager: which engines this node runs, how it watches them, and how it reports to
    the Controller."""

    port: int = setting(7300, c.PORT)
    """gRPC port of motor.v1.NodeManager."""
    controller: str = setting("127.0.0.1:7100", c.CONTROLLERS)
    """The Controller to register with. With standby Controllers (the etcd store), every one of
    them, comma-separated, or `dns:///name:port`: the NodeManager finds the leader and follows
    it to a new one after a failover (re-registering, engines untouched)."""
    controller_key_file: str = setting("", c.FILE)
    """Management key presented to the Controller."""
    job_name: str = setting("", c.text())
    """The job this node belongs to: NodeManagers with the same job name form one instance.
    "" = do not register (the NodeManager serves its API and logs `registration_disabled`)."""
    role: str = setting("prefill", c.choice("prefill", "decode", "union"))
    """The instance's role: `prefill`, `decode`, or `union` (serves whole requests)."""
    model: str = setting("motor-sim", c.NONEMPTY)
    """The model the engines load (a name or a local path)."""
    served_model_name: str = setting("", c.text())
    """The model name clients ask for; "" = the same as `model`."""
    engine_type: str = setting("sim", c.choice("vllm", "sglang", "sim"))
    """Which engine to launch: `vllm serve`, `python -m sglang.launch_server`, or the built-in
    simulated engine."""
    sim_protocol: str = setting("vllm", c.choice("vllm", "sglang"))
    """The KV hand-off protocol the simulated engine speaks."""
    # Engine k also uses port + 1, hence 65534; 0 cannot be probed.
    ports: tuple[int, ...] = setting((10000,), c.array(c.integer(1, 65534), nonempty=True))
    """One business (HTTP) port per engine this node runs (one engine per DP rank). An engine
    with business port P also uses P + 1 (SGLang bootstrap, vLLM DP RPC on the DP master),
    P + 2000 and P + 2001 (its KV cache events and their replay), P + 4000 (vLLM NIXL side
    channel) and P + 6000 (multi-node rendezvous on a rank's head); an offset that would pass
    65535 is subtracted instead."""
    device_count: int = setting(0, c.integer(0, 4096))
    """Accelerators on this node, split evenly between its engines."""
    device_env: str = setting("auto", c.DEVICE_ENV)
    """Environment variable that gives each engine its slice of devices, or `cpu`: the CPU
    platform, where each engine gets its own share of `cpu_cores` instead (and no device
    variable). `auto`: chosen at start-up, `CUDA_VISIBLE_DEVICES` when `nvidia-smi` is on PATH
    or `/dev/nvidia0` exists, `ASCEND_RT_VISIBLE_DEVICES` when `/dev/davinci<N>` exists, else
    `cpu` (logged as `event=device_env`)."""
    cpu_cores: tuple[int, ...] = setting((), c.CPU_CORES)
    """CPU platform: the cores this node's engines may use, in order (`[0, 1, 2, 3]` or
    `"0-3"`); empty = every core the NodeManager may run on (its affinity). They are split
    into contiguous, equal slices (the first ones one core larger when it does not divide), one
    per engine in endpoint id order; with fewer cores than engines, each engine gets one core
    and they share them round-robin. An engine's slice goes to vLLM as
    `VLLM_CPU_OMP_THREADS_BIND` and to SGLang as `SGLANG_CPU_OMP_THREADS_BIND` (split further
    between its tensor/pipeline-parallel workers); logged as `event=cpu_cores`. `motor up` sets
    it for each NodeManager to its engines' share of the machine."""
    ucx_port_range: str = setting("", c.PORT_RANGE)
    """TCP ports the UCX listeners of this node's engines (the transport of vLLM's NIXL KV
    connector) may take, `"LOW-HIGH"`: split into equal windows, one per engine in endpoint id
    order, each passed as `UCX_TCP_PORT_RANGE`, so engines never take each other's or Motor's
    ports and a firewall can open exactly these. "" = none set (the kernel picks free ones).
    UCX takes one port per worker thread per network device (vLLM's NIXL: 5 per worker process)
    and waits for a free one for as long as it takes, so leave room. `motor up` gives engine k
    the 16 * tp * pp ports from 18000 + k * 16 * tp * pp, or, when this is set, splits it over
    every engine of the cluster (both moved by --port-offset). An engine.env
    `UCX_TCP_PORT_RANGE` is kept."""
    pod_index: int = setting(-1, c.integer(-1, 1_000_000))
    """Kubernetes: the pod's StatefulSet ordinal, so that one StatefulSet per role holds whole
    instances (docs/kubernetes.md, "Scaling"). When 0 or more, pods are grouped by ordinal,
    `parallel.nnodes` per instance: this node's rank is `pod_index % nnodes` (`node_rank` is
    ignored) and its job is `<job_name>-<pod_index // nnodes>`. -1 = not used."""
    node_rank: int = setting(0, c.integer(0, 1_000_000))
    """This node's rank in a multi-node instance (0 .. nnodes-1); rank 0 serves requests, the
    others run headless."""
    parallel: Parallel = setting(ONE_OF_EACH, c.PARALLEL, typed=Parallel.from_json)
    """Parallel sizes of the instance: `dp` (DP ranks, one engine and one routable endpoint
    each), `tp`, `pp` (per rank), `ep`, and `nnodes` (nodes each rank spans: node_rank 0 serves,
    the others run headless)."""
    state_dir: str = setting(".motor/nm", c.DIRECTORY)
    """Directory of `engines.json`, the record of engine process groups (so a restarted
    NodeManager can stop the engines an earlier one left behind)."""
    status_poll_interval_s: float = setting(1, c.DURATION)
    """How often each engine's `/health` is probed once it has answered (every 0.1 s before,
    so a started engine is in service at once)."""
    status_probe_timeout_s: float = setting(2, c.DURATION)
    """Deadline of one health probe."""
    max_probe_failures: int = setting(2, c.COUNT)
    """Consecutive failed probes after which a once-healthy engine is ABNORMAL."""
    engine_startup_timeout_s: float = setting(1800, c.DURATION)
    """Start-up window: probe failures do not count while a model loads. An engine not healthy by
    its end is named in one `engine_startup_timeout` warning (pid, seconds waited, its last
    output lines), killed and reported dead, so the Controller relaunches it like a hung one."""
    engine_hang_timeout_s: float = setting(9, c.DURATION)
    """An engine ABNORMAL this long (after it had been NORMAL) is killed and reported dead, so
    the Controller relaunches it in place. Must be shorter than
    `suicide_check_interval_s * (suicide_threshold - 1)`, the least time the pod-restart
    fallback may take to act on an ABNORMAL engine (its first check may come right after the
    engine turned ABNORMAL); a config where it is not is refused."""
    engine_probe_inference: bool = setting(False, c.BOOLEAN)
    """Also probe with a real request, for an engine whose `/health` answers while its
    scheduler is wedged: every `probe_inference_interval_s`, `POST /v1/completions` with
    `{"model": <served name>, "prompt": "1", "max_tokens": 1}` and `X-Request-Id:
    <unix time>_virtual` (SGLang prefill and decode engines also get SGLang's fake
    bootstrap host, so no KV transfer is attempted). Only the NodeManager running DP rank 0 of
    the instance (endpoint 0) sends it, and only once that engine has been NORMAL.
    `probe_inference_failures` failures in a row make the endpoint ABNORMAL, and
    `engine_hang_timeout_s` later it is killed like any hung engine."""
    probe_inference_interval_s: float = setting(5, c.DURATION)
    """How often the inference probe is sent. It is also each probe's deadline: one not
    answered 200 within it fails and the next starts at once (never two at a time). A
    loaded engine must answer a one-token request within this; raise it for engines that run
    at full batch for long."""
    probe_inference_failures: int = setting(6, c.COUNT)
    """Consecutive failed inference probes that make the endpoint ABNORMAL; one success resets
    the count."""
    engine_stop_grace_s: float = setting(10, c.seconds(0, c.WEEK))  # 0: kill at once
    """Time between SIGTERM and SIGKILL when engines are stopped."""
    drain_wait_s: float = setting(45, c.seconds(0, 3600))
    """On SIGTERM, the longest the NodeManager waits for the Controller to drain its instance and
    send Stop before it stops its engines itself (see docs/operations.md, "Planned drains"). At
    least the Coordinators' `drain_grace_s` (30) plus the Controller's 5 s margin and its Stop
    round; 0: stop at once, without a drain."""
    suicide_check_interval_s: float = setting(3, c.DURATION)
    """How often the pod-restart fallback looks for broken engines."""
    suicide_threshold: int = setting(5, c.COUNT)
    """Consecutive checks with a broken engine after which the NodeManager stops its engines and
    exits non-zero, so its pod (or `motor up`) restarts it."""
    engine_restart_wait_timeout_s: float = setting(180, c.DURATION)
    """After a death report the Controller acknowledged (with relaunch on), the fallback waits
    this long for the relaunch to start."""
    engine_restart_freeze_s: float = setting(720, c.DURATION)
    """How long a relaunch holds the fallback off; it must outlast the Controller's relaunch
    timeout."""
    metrics_port: int = setting(0, c.PORT)
    """Port of the Prometheus `GET /metrics` endpoint (plain HTTP on `host`); 0 = off.
    `motor up` sets 9300 + i for NodeManager i."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig(ServerConfig):
    """What the NodeManager passes to every engine it launches."""

    args: Mapping[str, Any] = setting({}, c.JSON_OBJECT)
    """Extra engine flags, sorted by key: `"max_model_len": 4096` → `--max-model-len 4096`;
    true → a bare flag; false/null → omitted; a list repeats the flag; an object is passed as
    compact JSON. A `kv_transfer_config` or `kv_events_config` here replaces Motor's flag whole
    (its `kv_role` and `engine_id` are then yours to set); `kv_transfer_config` below adds
    fields to Motor's instead."""
    kv_connector: str = setting("NixlConnector", c.NONEMPTY)
    """vLLM KV connector named in `--kv-transfer-config` of prefill and decode engines (unless
    `kv_transfer_config` names one)."""
    kv_transfer_config: Mapping[str, Any] = setting({}, c.KV_TRANSFER_CONFIG)
    """vLLM: more fields of the `--kv-transfer-config` of prefill and decode engines, added to
    Motor's `kv_connector`, `kv_role` and `engine_id` after them (sorted by key; objects inside
    are passed as written): `{"kv_buffer_device": "cpu"}`,
    `{"kv_connector_extra_config": {…}}`. A `kv_connector` here wins over the key above (a
    `MultiConnector` with its `connectors` in `kv_connector_extra_config`); `kv_role` and
    `engine_id` are Motor's and refused. SGLang engines do not take this flag."""
    env: Mapping[str, str] = setting({}, c.ENVIRONMENT)
    """Extra environment variables of every engine (values are never logged). Motor's own
    variables are set after these, except `VLLM_CPU_OMP_THREADS_BIND`,
    `SGLANG_CPU_OMP_THREADS_BIND` and `VLLM_CPU_KVCACHE_SPACE`: set here, they are kept."""
    cpu_kvcache_space_gib: int = setting(0, c.integer(0, 1 << 20))
    """vLLM CPU builds: GiB of memory for each engine's KV cache, passed to every vLLM engine
    as `VLLM_CPU_KVCACHE_SPACE` (other builds ignore it); 0 = not set (vLLM's default, 4 GiB).
    SGLang has no such variable: it sizes its cache from `mem_fraction_static` or
    `max_total_tokens` in `args`."""
    data_parallel_group: bool = setting(True, c.BOOLEAN)
    """vLLM: the DP ranks of an instance form one vLLM data-parallel group (a shared DP master,
    `--data-parallel-rank`), which mixture-of-experts models need. false: every rank is an
    independent vLLM with `--data-parallel-size 1`, for dense models, which vLLM 0.33 refuses to
    group. SGLang ranks are always independent."""


@dataclass(frozen=True)
class Config:
    """Every section, each with every key filled."""

    controller: ControllerConfig
    coordinator: CoordinatorConfig
    nodemanager: NodeManagerConfig
    engine: EngineConfig

    def section(self, name: str) -> ServerConfig:
        """The section called ``name`` (one of SECTIONS)."""
        value: ServerConfig = getattr(self, name)
        return value


SECTION_TYPES: dict[str, type[ServerConfig]] = {
    "controller": ControllerConfig,
    "coordinator": CoordinatorConfig,
    "nodemanager": NodeManagerConfig,
    "engine": EngineConfig,
}
SECTIONS = tuple(SECTION_TYPES)


def keys(cls: type[ServerConfig]) -> list[dataclasses.Field[Any]]:
    """A section's keys: its own first, then the shared ones."""
    mine = vars(cls).get("__annotations__", {})
    own = [f for f in dataclasses.fields(cls) if f.name in mine]
    shared = [f for f in dataclasses.fields(cls) if f not in own]
    return own + shared


def to_json(value: Any) -> Any:
    """A typed value in the shape JSON gives it (tuples as lists, objects as dicts)."""
    if isinstance(value, tuple):
        return [to_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return copy.deepcopy(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING
    return f.default_factory()


SCHEMA: dict[str, dict[str, tuple[Any, c.Check]]] = {
    name: {f.name: (to_json(_default(f)), f.metadata["check"]) for f in keys(cls)}
    for name, cls in SECTION_TYPES.items()
}


def typed(cls: type[ServerConfig], values: Mapping[str, Any]) -> Any:
    """The section object for checked JSON ``values`` (every key present)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        raw = values[f.name]
        convert = f.metadata["typed"]
        if convert is not None:
            kwargs[f.name] = convert(raw)
        elif isinstance(raw, list):
            kwargs[f.name] = tuple(raw)
        elif isinstance(raw, dict):
            kwargs[f.name] = MappingProxyType(copy.deepcopy(raw))
        else:
            kwargs[f.name] = raw
    return cls(**kwargs)


def docs(cls: type) -> dict[str, str]:
    """Each field's documentation: the string literal written under it, in ``cls`` or a base."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, after in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                found[stmt.target.id] = inspect.cleandoc(after.value.value)
    return found
