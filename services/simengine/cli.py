"""`motor engine-sim`: argv parsing.

The NodeManager launches the simulated engine with the same flags it gives `vllm serve` and
`sglang.launch_server`, so both spellings are accepted here; any other `--flag` is logged and
ignored, as a real engine would have a thousand knobs we do not model.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid

from motor_mesh.common import log
from motor_mesh.simengine.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MODEL,
    DEFAULT_NUM_BLOCKS,
    PREFILL_COMPUTE,
    EngineConfig,
    KvEventsConfig,
)
from motor_mesh.simengine.faults import MODES


def _nonneg_float(text: str) -> float:
    value = float(text)
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _pos_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text}")
    return value


def _status(text: str) -> int:
    value = int(text)
    if not 100 <= value <= 599:
        raise argparse.ArgumentTypeError(f"not an HTTP status: {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown vLLM flag such as --max-num must not silently match ours.
    p = argparse.ArgumentParser(
        prog="motor engine-sim",
        usage="motor engine-sim [serve] [MODEL] [flags]",
        description="Simulated vLLM/SGLang-compatible engine (OpenAI API, PD hand-off, fault injection).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model and server")
    g.add_argument("--model", "--model-path", dest="model_flag", metavar="M", help="model name or local path")
    g.add_argument("--served-model-name", nargs="+", metavar="N", help="name(s) clients use")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=_port, default=10000, help="HTTP port; 0 binds an ephemeral port")
    g.add_argument("--protocol", choices=("vllm", "sglang"), help="PD hand-off protocol (default vllm)")
    g.add_argument(
        "--bootstrap-port",
        "--disaggregation-bootstrap-port",
        dest="bootstrap_port",
        type=_port,
        metavar="B",
        help="SGLang bootstrap rendezvous port (prefill role; default PORT+1, or ephemeral with --port 0)",
    )
    g.add_argument("--disaggregation-mode", choices=("prefill", "decode", "null"))
    g.add_argument("--kv-transfer-config", metavar="JSON")
    g.add_argument("--tensor-parallel-size", "--tp-size", "-tp", dest="tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "--dp-size", "-dp", dest="dp", type=int, default=1)
    g.add_argument("--data-parallel-address", dest="dp_address")
    g.add_argument("--data-parallel-rpc-port", dest="dp_rpc_port", type=_port)
    g.add_argument("--data-parallel-rank", dest="dp_rank", type=int)
    g.add_argument(
        "--max-model-len", "--context-length", dest="max_model_len", type=_pos_int,
        default=DEFAULT_MAX_MODEL_LEN, metavar="N",
        help=f"context length in tokens, prompt and output together (default {DEFAULT_MAX_MODEL_LEN}): "
        "reported by /v1/models; a longer request is a 400, as in vLLM",
    )  # fmt: skip
    g.add_argument("--headless", action="store_true", help="serve no HTTP; live until signalled")
    g.add_argument("--log-format", choices=("kv", "json"), default="kv")
    g.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        default="",
        help="export a span per completion request over OTLP/gRPC, as vLLM does "
        "(OTEL_EXPORTER_OTLP_ENDPOINT alone does the same)",
    )
    kv = p.add_argument_group("prefix cache and KV cache events (vLLM's flags)")
    kv.add_argument(
        "--block-size", "--page-size", dest="block_size", type=_pos_int, default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV block",
    )  # fmt: skip
    kv.add_argument(
        "--num-gpu-blocks-override", dest="num_gpu_blocks", type=_pos_int, default=DEFAULT_NUM_BLOCKS,
        metavar="N", help=f"prefix cache capacity in blocks (default {DEFAULT_NUM_BLOCKS})",
    )  # fmt: skip
    kv.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="cache prompt blocks: a cached prefix is not prefilled again (default on, as in vLLM V1)",
    )  # fmt: skip
    kv.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false")
    kv.add_argument(
        "--tokenizer", "--tokenizer-path", dest="tokenizer", metavar="PATH",
        help="tokenizer.json or a directory with one (default: the model's directory, else one "
        "token per whitespace-separated word)",
    )  # fmt: skip
    kv.add_argument(
        "--kv-events-config", metavar="JSON", help="vLLM's KVEventsConfig: ZMQ publisher of block events"
    )
    lat = p.add_argument_group("latency model (all zero: instant engine)")
    lat.add_argument("--ttft-ms", type=_nonneg_float, default=0.0)
    lat.add_argument("--prefill-ms-per-token", type=_nonneg_float, default=0.0)
    lat.add_argument("--tpot-ms", type=_nonneg_float, default=0.0)
    lat.add_argument(
        "--prefill-compute", choices=PREFILL_COMPUTE, default="parallel",
        help="parallel (default): every prefill runs at once, each in its own slot; serial: "
        "prefills share one compute (a compute-bound engine), done one after another in arrival "
        "order, those queued counted in vllm:num_requests_waiting",
    )  # fmt: skip
    lat.add_argument(
        "--tpot-ms-per-seq", type=_nonneg_float, default=0.0, metavar="X",
        help="memory-bound decode: each output token takes --tpot-ms + X x (running sequences - 1) "
        "ms (default 0: --tpot-ms whatever the batch)",
    )  # fmt: skip
    lat.add_argument("--kv-transfer-ms", type=_nonneg_float, default=0.0)
    lat.add_argument(
        "--max-num-seqs", "--max-running-requests", dest="max_num_seqs", type=_nonneg_int, default=0
    )
    lat.add_argument("--bootstrap-timeout-s", type=_nonneg_float, default=30.0)
    proc = p.add_argument_group("process tree and faults")
    proc.add_argument("--workers", type=_nonneg_int, default=0, help="child processes living with the leader")
    proc.add_argument(
        "--fault",
        choices=MODES,
        default="none",
        help="fault to inject (see faults.py); hang: a wedged scheduler, completions never answer "
        "while /health keeps answering 200; die_after_tokens: SIGKILL itself once it has sent "
        "--fault-after-tokens output tokens (mid-stream)",
    )
    proc.add_argument("--fault-after-requests", type=_nonneg_int, default=0)
    proc.add_argument("--fault-after-s", type=_nonneg_float, default=0.0)
    proc.add_argument(
        "--fault-after-tokens",
        type=_nonneg_int,
        default=0,
        metavar="N",
        help="die_after_tokens: output tokens sent, across all requests, before the engine dies",
    )
    proc.add_argument("--fault-status", type=_status, default=500)
    proc.add_argument(
        "--startup-s",
        type=_nonneg_float,
        default=0.0,
        metavar="S",
        help="start-up time: /health answers 503 for S seconds after start, as a real engine "
        "loading its model (the first such answer logs one `event=loading` line); inf = never "
        "healthy, a start-up that hangs. POST /sim/ready (loopback clients only) ends it at once",
    )
    proc.add_argument("--seed", type=int, default=0)
    return p


def _split_positionals(argv: list[str]) -> tuple[str | None, list[str]]:
    """`[serve] [MODEL] flags...`: positionals only before the first flag, so an unknown flag's
    value is never mistaken for the model."""
    rest = list(argv)
    if rest and rest[0] == "serve":
        rest.pop(0)
    model = None
    if rest and not rest[0].startswith("-"):
        model = rest.pop(0)
    return model, rest


def parse(argv: list[str]) -> tuple[EngineConfig, list[str]]:
    """Parse argv into a config; returns the ignored unknown flags too. Raises SystemExit(2)."""
    parser = build_parser()
    positional_model, rest = _split_positionals(argv)
    ns, unknown = parser.parse_known_args(rest)
    kv: dict[str, object] = {}
    if ns.kv_transfer_config:
        try:
            loaded = json.loads(ns.kv_transfer_config)
        except ValueError as exc:
            parser.error(f"--kv-transfer-config: invalid JSON: {exc}")
        if not isinstance(loaded, dict):
            parser.error("--kv-transfer-config: must be a JSON object")
        kv = loaded
    kv_events = KvEventsConfig()
    if ns.kv_events_config:
        try:
            kv_events = KvEventsConfig.from_json(json.loads(ns.kv_events_config))
        except json.JSONDecodeError as exc:
            parser.error(f"--kv-events-config: invalid JSON: {exc}")
        except ValueError as exc:
            parser.error(f"--kv-events-config: {exc}")
    mode = ns.disaggregation_mode if ns.disaggregation_mode in ("prefill", "decode") else None
    kv_role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(str(kv.get("kv_role", "")))
    role = mode or kv_role or "union"
    protocol = ns.protocol or ("sglang" if ns.disaggregation_mode is not None else "vllm")
    bootstrap_port = ns.bootstrap_port
    if bootstrap_port is None:
        bootstrap_port = ns.port + 1 if 0 < ns.port < 65535 else 0
    cfg = EngineConfig(
        model=ns.model_flag or positional_model or DEFAULT_MODEL,
        served_model_names=list(ns.served_model_name or []),
        host=ns.host,
        port=ns.port,
        protocol=protocol,
        role=role,
        bootstrap_port=bootstrap_port,
        tp=ns.tp,
        dp=ns.dp,
        dp_address=ns.dp_address,
        dp_rpc_port=ns.dp_rpc_port,
        dp_rank=ns.dp_rank,
        headless=ns.headless,
        kv_transfer_config=kv,
        engine_id=str(kv.get("engine_id") or uuid.uuid4().hex),
        block_size=ns.block_size,
        num_gpu_blocks=ns.num_gpu_blocks,
        enable_prefix_caching=ns.enable_prefix_caching,
        tokenizer=ns.tokenizer,
        max_model_len=ns.max_model_len,
        kv_events=kv_events,
        ttft_ms=ns.ttft_ms,
        prefill_ms_per_token=ns.prefill_ms_per_token,
        tpot_ms=ns.tpot_ms,
        prefill_compute=ns.prefill_compute,
        tpot_ms_per_seq=ns.tpot_ms_per_seq,
        kv_transfer_ms=ns.kv_transfer_ms,
        max_num_seqs=ns.max_num_seqs,
        bootstrap_timeout_s=ns.bootstrap_timeout_s,
        workers=ns.workers,
        fault=ns.fault,
        fault_after_requests=ns.fault_after_requests,
        fault_after_s=ns.fault_after_s,
        fault_after_tokens=ns.fault_after_tokens,
        fault_status=ns.fault_status,
        startup_s=ns.startup_s,
        seed=ns.seed,
        log_format=ns.log_format,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
    )
    return cfg, unknown


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def main(argv: list[str]) -> int:
    try:
        cfg, unknown = parse(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    log.setup("engine-sim", cfg.log_format)
    for token in unknown:
        if token.startswith("-") and not _is_number(token):
            log.event("unknown_flag", flag=token.split("=", 1)[0])
    from motor_mesh.simengine.server import run  # heavy imports only once argv is valid

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
