"""``motor up``'s command line."""

from __future__ import annotations

import argparse

EPILOG = """\
ports (defaults, each + --port-offset): Controller 7100, Coordinator gRPC 7200 and HTTP 8000,
NodeManager i 7300 + i; Prometheus /metrics of the Controller 9100 and of NodeManager i 9300 + i
(controller.metrics_port / nodemanager.metrics_port when set). Engines are numbered k = 0, 1, ...
across the NodeManagers (prefill, decode, union): NodeManager i runs engines i*dp .. i*dp+dp-1,
one per DP rank, and engine k serves on nodemanager.ports[0] + 2k (10000 + 2k) and uses that
port + 1 too (SGLang bootstrap, vLLM DP RPC). Real engines also use port + 4000 (vLLM NIXL side
channel).

--ha: an etcd (client 2379, peer 2380, data in <state-dir>/etcd) and two Controllers on it,
controller-0 on 7100 (metrics 9100) and controller-1 on 7101 (metrics 9101): one leads, the other
stands by and takes over when the leader goes. NodeManagers and the Coordinator follow the
leader; give the operator commands both too: motor status --controller 127.0.0.1:7100,127.0.0.1:7101
(each port + --port-offset).

While it runs, motor up follows the Controller's desired instance counts, which it sets at start
to its --prefill/--decode/--union counts. With one decode instance, motor scale --role decode
--replicas 3 starts two more (on the next NodeManager numbers and their ports); --replicas 1 then
drains the highest-numbered ones (TerminateInstance) and stops them. motor scale's --controller is
127.0.0.1:7100 + --port-offset."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="motor up",
        description="Run a whole local Motor cluster.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill", type=int, help="prefill instances (default 1 when no count is given)")
    p.add_argument("--decode", type=int, help="decode instances (default 1 when no count is given)")
    p.add_argument("--union", type=int, help="union instances (default 0)")
    p.add_argument(
        "--dp",
        type=int,
        metavar="N",
        help="DP ranks per instance, one engine each (default: nodemanager.parallel.dp, else 1)",
    )
    p.add_argument(
        "--engine-type",
        "--engine",
        dest="engine_type",
        choices=["sim", "vllm", "sglang"],
        default="sim",
        help="engine software (default sim); vllm must be on PATH, sglang importable",
    )
    p.add_argument(
        "--sim-protocol",
        choices=["vllm", "sglang"],
        default="vllm",
        help="KV hand-off the simulated engine speaks (default vllm)",
    )
    p.add_argument("--model", default="motor-sim", help="model every engine serves (default motor-sim)")
    p.add_argument("--config", metavar="FILE", help="sectioned JSON config applied to every component")
    p.add_argument(
        "--ha",
        action="store_true",
        help="two Controllers, a leader and a standby, sharing their state in an etcd started "
        "first (etcd on PATH or /usr/bin/etcd); see below",
    )
    p.add_argument("--port-offset", type=int, default=0, help="added to every default port")
    p.add_argument("--state-dir", help="state directory (default: a fresh temporary directory)")
    args = p.parse_args(argv)
    if args.prefill is None and args.decode is None and args.union is None:
        args.prefill, args.decode, args.union = 1, 1, 0
    args.prefill, args.decode, args.union = args.prefill or 0, args.decode or 0, args.union or 0
    if min(args.prefill, args.decode, args.union) < 0 or args.prefill + args.decode + args.union == 0:
        p.error("instance counts must be >= 0 and at least one instance is needed")
    if args.dp is not None and args.dp < 1:
        p.error("--dp must be >= 1")
    return args
