"""Settings of one simulated engine process, as parsed from argv."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_MODEL = "motor-sim"
ROLES = ("prefill", "decode", "union")
PROTOCOLS = ("vllm", "sglang")


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
    # latency model
    ttft_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    tpot_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    max_num_seqs: int = 0
    bootstrap_timeout_s: float = 30.0
    # process tree
    workers: int = 0
    # faults
    fault: str = "none"
    fault_after_requests: int = 0
    fault_after_s: float = 0.0
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
