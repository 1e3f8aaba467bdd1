"""Settings of one simulated engine process, as parsed from argv."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "motor-sim"
ROLES = ("prefill", "decode", "union")
PROTOCOLS = ("vllm", "sglang")
# --prefill-compute: each prefill on its own (today's model), or one compute shared in turn.
PREFILL_COMPUTE = ("parallel", "serial")
DEFAULT_BLOCK_SIZE = 16
# vLLM sizes its cache from GPU memory; without a GPU the sim needs a number (1M tokens at 16).
DEFAULT_NUM_BLOCKS = 65536
# vLLM takes a model's context length from its config; the sim has none, so a long one.
DEFAULT_MAX_MODEL_LEN = 131072
_KV_EVENTS_TYPES: dict[str, type] = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int}


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's `--kv-events-config` (KVEventsConfig): where KV cache events are published."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # vLLM: "zmq" when events are enabled and no publisher is named
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, obj: Any) -> KvEventsConfig:
        """The config from the flag's parsed JSON; ValueError names what is wrong. Keys this
        engine does not model (max_queue_size, newer vLLM's) are accepted and ignored."""
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        values: dict[str, Any] = {k: obj[k] for k in cls.__dataclass_fields__ if obj.get(k) is not None}
        for name, value in values.items():
            kind = _KV_EVENTS_TYPES.get(name, str)
            if type(value) is not kind or (isinstance(value, int) and value < 0):
                raise ValueError(f"{name}: expected a {kind.__name__}, got {value!r}")
        if "publisher" not in values:
            values["publisher"] = "zmq" if values.get("enable_kv_cache_events") else "null"
        if values["publisher"] not in ("null", "zmq"):
            raise ValueError(f"publisher: unknown publisher {values['publisher']!r} (null or zmq)")
        return cls(**values)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    served_model_names: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 10000
    protocol: str = "vllm"
    role: str = "union"
    bootstrap_port: int | None = None
    tp: int = 1
    dp: int = 1
    dp_address: str | None = None
    dp_rpc_port: int | None = None
    dp_rank: int | None = None
    headless: bool = False
    kv_transfer_config: dict[str, object] = field(default_factory=dict)
    engine_id: str = ""
    # prefix cache and KV events (vLLM's flags)
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_NUM_BLOCKS
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # None: the model's, when it is a local directory
    # Context length in tokens (prompt + output), reported by /v1/models and enforced as vLLM does.
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    # latency model
    ttft_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    tpot_ms: float = 0.0
    # Load-dependent latency (opt-in): prefills share one compute, one after another ("serial");
    # each output token's interval grows by this much per other running sequence.
    prefill_compute: str = "parallel"
    tpot_ms_per_seq: float = 0.0
    kv_transfer_ms: float = 0.0
    max_num_seqs: int = 0
    bootstrap_timeout_s: float = 30.0
    # process tree
    workers: int = 0
    # faults
    fault: str = "none"
    fault_after_requests: int = 0
    fault_after_s: float = 0.0
    fault_after_tokens: int = 0  # die_after_tokens: output tokens sent before the engine dies
    fault_status: int = 500
    startup_s: float = 0.0
    seed: int = 0
    log_format: str = "kv"
    otlp_traces_endpoint: str = ""  # tracing (also on with OTEL_EXPORTER_OTLP_ENDPOINT)

    @property
    def model_id(self) -> str:
        """The id /v1/models reports: a local directory is reported by path so that peer routers
        load the tokenizer from disk instead of trying to download one."""
        if self.served_model_names:
            return self.served_model_names[0]
        if os.path.isdir(self.model):
            return os.path.abspath(self.model)
        return self.model

    @property
    def model_ids(self) -> list[str]:
        return list(self.served_model_names) or [self.model_id]

    @property
    def accepted_models(self) -> frozenset[str]:
        names = {*self.model_ids, self.model}
        if os.path.isdir(self.model):
            names.add(os.path.abspath(self.model))
        return frozenset(names)

    @property
    def sglang(self) -> bool:
        return self.protocol == "sglang"

    @property
    def data_parallel_rank(self) -> int:
        return self.dp_rank or 0
