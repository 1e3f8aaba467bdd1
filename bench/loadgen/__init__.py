"""Load-generation helpers for the control-plane benchmarks (bench_scale, bench_propagation).

- ``node.FakeNode``: a simulated NodeManager's Controller side (Register + Heartbeat stream).
- ``fakenm.FakeNodeManagers``: one motor.v1.NodeManager server answering for many fake nodes.
- ``fleet``: a generator process (``python -m bench.loadgen.fleet``) driving thousands of nodes.
- ``echo``: an echo-only Controller (``python -m bench.loadgen.echo``), the CPU baseline.
- ``harness``: process start, CPU pinning, /proc CPU accounting, ``event=listening`` parsing.
- ``etcd_proc.Etcd``: a one-member etcd on free ports, pinned to CPUs, its database size read.
- ``fleets``: bench_scale's side of the generator processes: start them, sum their counts, wait.
- ``scale_report``: results/scale.md from scale.json, one row per Controller run (SQLite or etcd).
- ``failover_load``: bench_failover's client load (failed requests) and process age (restart backoff).
- ``controller_failover``: bench_failover's Controller part: SIGKILL the ``motor up --ha`` leader.
- ``metrics_farm``: bench_engine_metrics' stand-in engines: one process answering ``/metrics`` with
  a vLLM V1 exposition on many ports (``python -m bench.loadgen.metrics_farm --count N``).
"""
