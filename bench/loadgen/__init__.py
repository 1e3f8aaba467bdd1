"""Load-generation helpers for the control-plane benchmarks (bench_scale, bench_propagation).

- ``node.FakeNode``: a simulated NodeManager's Controller side (Register + Heartbeat stream).
- ``fakenm.FakeNodeManagers``: one motor.v1.NodeManager server answering for many fake nodes.
- ``fleet``: a generator process (``python -m bench.loadgen.fleet``) driving thousands of nodes.
- ``echo``: an echo-only Controller (``python -m bench.loadgen.echo``), the CPU baseline.
- ``harness``: process start, CPU pinning, /proc CPU accounting, ``event=listening`` parsing.
"""
