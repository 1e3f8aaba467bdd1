"""The launch case table of ``make engines-check`` (tools/engines_check), without the engines.

Every case goes through the real config loader, assembly plan and launch functions; here its
cross-process invariants must hold and a few launch lines are pinned word for word. The same
table is fed to real vLLM and SGLang by ``make engines-check``."""

from __future__ import annotations

import copy
import sys

import pytest

from tools.engines_check import cases, invariants
from tools.engines_check.cases import Launch

TABLE = cases.build()
KV_PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"1"}'
KV_CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"1"}'


def kv_events(endpoint: int) -> str:
    """The --kv-events-config naming ``endpoint`` (replay: + 1), before the engine adds its DP rank."""
    return (
        f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{endpoint}",'
        f'"replay_endpoint":"tcp://*:{endpoint + 1}","topic":""}}'
    )


def launch_of(case: str, instance: str, endpoint_id: int) -> Launch:
    [found] = [x for x in TABLE[case] if x["instance"] == instance and x["endpoint_id"] == endpoint_id]
    return found


def nixl(x: Launch) -> tuple[str, str]:
    return x["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"], x["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]


def test_table_has_every_shape() -> None:
    assert len(TABLE) == 36
    shapes = {(c.engine, c.role, c.dp, c.nodes, c.dense) for c in cases.CASES}
    assert shapes == {
        (e, r, dp, n, False)
        for e in ("vllm", "sglang")
        for r in ("prefill", "decode", "union")
        for dp in (1, 2)
        for n in (1, 2)
    } | {("vllm", r, dp, n, True) for r in ("prefill", "decode", "union") for dp in (1, 2) for n in (1, 2)}
    for case in cases.CASES:
        launches = TABLE[case.name]
        # The instance under check and a partner of the other role, on the same hosts.
        assert {x["instance"] for x in launches} == {f"{case.role}-1", f"{cases.PARTNER[case.role]}-2"}
        assert len(launches) == 2 * case.dp * case.nodes
        assert {x["host"] for x in launches} == set(cases.HOSTS[: case.nodes])
        # Motor's loader turned the case's engine section into the launch's DP grouping.
        assert {(x["model_kind"], x["dp_group"]) for x in launches} == {(case.model_kind, not case.dense)}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_invariants_hold(name: str) -> None:
    assert invariants.check(TABLE[name]) == []


def test_vllm_prefill_dp2_one_node() -> None:
    case = "vllm-prefill-dp2-nodes1"
    # vLLM listens on the env port + its DP rank: 14000 and 14002, the business ports + 4000.
    for rank, port, side_channel in ((0, 10000, "14000"), (1, 10002, "14001")):
        x = launch_of(case, "prefill-1", rank)
        assert x["argv"] == [
            "vllm", "serve", "/models/tiny-moe",
            "--served-model-name", "tiny-moe",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--tensor-parallel-size", "1",
            "--data-parallel-size", "2",
            "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", "10001",
            "--data-parallel-rank", str(rank),
            "--kv-transfer-config", KV_PRODUCER,
            # vLLM adds its DP rank: it publishes on 12000 and 12002, the business ports + 2000.
            "--kv-events-config", kv_events(port + 2000 - rank),
        ]  # fmt: skip
        assert nixl(x) == ("127.0.0.1", side_channel)
        assert x["env"]["CUDA_VISIBLE_DEVICES"] == str(rank)
    # The decode partner on the same host listens on 14004 and 14006.
    assert [nixl(launch_of(case, "decode-2", r)) for r in (0, 1)] == [
        ("127.0.0.1", "14004"),
        ("127.0.0.1", "14005"),
    ]


def test_vllm_decode_dp2_two_nodes() -> None:
    case = "vllm-decode-dp2-nodes2"
    head = launch_of(case, "decode-1", 1)  # DP rank 1's routable part, on node_rank 0
    assert head["argv"] == [
        "vllm", "serve", "/models/tiny-moe",
        "--served-model-name", "tiny-moe",
        "--host", "127.0.0.1",
        "--port", "10002",
        "--tensor-parallel-size", "2",
        "--data-parallel-size", "2",
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", "10001",
        "--data-parallel-rank", "1",
        "--nnodes", "4",
        "--node-rank", "2",
        "--master-addr", "127.0.0.1",
        "--master-port", "16000",
        "--kv-transfer-config", KV_CONSUMER,
        "--kv-events-config", kv_events(12001),  # DP rank 1 publishes on 12002
    ]  # fmt: skip
    headless = launch_of(case, "decode-1", 3)  # DP rank 1's part on node_rank 1
    assert (headless["host"], headless["node_rank"], headless["headless"]) == ("127.0.0.2", 1, True)
    assert headless["argv"] == [
        "vllm", "serve", "/models/tiny-moe",
        "--served-model-name", "tiny-moe",
        "--host", "127.0.0.2",
        "--port", "10002",
        "--tensor-parallel-size", "2",
        "--data-parallel-size", "2",
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", "10001",
        "--data-parallel-rank", "1",
        "--nnodes", "4",
        "--node-rank", "3",
        "--master-addr", "127.0.0.1",
        "--master-port", "16000",
        "--headless",
        "--kv-transfer-config", KV_CONSUMER,
    ]  # fmt: skip
    assert nixl(head) == ("127.0.0.1", "14001")
    assert nixl(headless) == ("127.0.0.2", "14001")  # its own host, not the master's


def test_vllm_dense_decode_dp2_two_nodes_headless() -> None:
    # No DP group: rank 1 is a vLLM of its own, a two-node world meeting at its own head.
    case = "vllm-dense-decode-dp2-nodes2"
    x = launch_of(case, "decode-1", 3)  # DP rank 1's part on node_rank 1
    assert (x["host"], x["node_rank"], x["headless"], x["dp_group"]) == ("127.0.0.2", 1, True, False)
    assert x["argv"] == [
        "vllm", "serve", "/models/tiny-llama",
        "--served-model-name", "tiny-llama",
        "--host", "127.0.0.2",
        "--port", "10002",
        "--tensor-parallel-size", "2",
        "--data-parallel-size", "1",
        "--nnodes", "2",
        "--node-rank", "1",
        "--master-addr", "127.0.0.1",
        "--master-port", "16002",
        "--headless",
        "--kv-transfer-config", KV_CONSUMER,
    ]  # fmt: skip
    # vLLM's DP index is 0, so the env port is the listening port itself: business port + 4000.
    assert nixl(x) == ("127.0.0.2", "14002")
    assert nixl(launch_of(case, "decode-1", 1)) == ("127.0.0.1", "14002")  # rank 1's head
    assert x["env"]["CUDA_VISIBLE_DEVICES"] == "1"


def test_sglang_prefill_dp2_one_node() -> None:
    for rank, port in ((0, 10000), (1, 10002)):
        x = launch_of("sglang-prefill-dp2-nodes1", "prefill-1", rank)
        assert x["argv"] == [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", "/models/tiny-moe",
            "--served-model-name", "tiny-moe",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--tp-size", "1",
            "--dp-size", "1",
            "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(port + 1),
            "--enable-metrics",
            "--kv-events-config", kv_events(port + 2000),
        ]  # fmt: skip
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in x["env"]
        assert x["env"]["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "true"


def test_sglang_decode_dp1_two_nodes_headless() -> None:
    x = launch_of("sglang-decode-dp1-nodes2", "decode-1", 1)
    assert (x["host"], x["node_rank"], x["headless"]) == ("127.0.0.2", 1, True)
    assert x["argv"] == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/models/tiny-moe",
        "--served-model-name", "tiny-moe",
        "--host", "127.0.0.2",
        "--port", "10000",
        "--tp-size", "2",
        "--dp-size", "1",
        "--nnodes", "2",
        "--node-rank", "1",
        "--dist-init-addr", "127.0.0.1:16000",
        "--disaggregation-mode", "decode",
        "--disaggregation-bootstrap-port", "10001",
        "--enable-metrics",
    ]  # fmt: skip


# ---- the invariants can fail -------------------------------------------------------------------


def broken(case: str, instance: str, endpoint_id: int) -> tuple[list[Launch], Launch]:
    launches = copy.deepcopy(TABLE[case])
    [x] = [y for y in launches if y["instance"] == instance and y["endpoint_id"] == endpoint_id]
    return launches, x


def set_flag(x: Launch, flag: str, value: str) -> None:
    x["argv"][x["argv"].index(flag) + 1] = value


@pytest.mark.parametrize(
    ("case", "instance", "rank", "key", "value", "complaint"),
    [
        pytest.param(
            "vllm-prefill-dp2-nodes1", "prefill-1", 1, "--data-parallel-rpc-port", "10003",
            ["disagree on the DP master"], id="a rank with its own DP RPC port",
        ),
        # The decode partner's rank 1 pointed at the port the prefill instance's rank 1 listens
        # on: 14001 + rank 1 = prefill-1 rank 1's 14002.
        pytest.param(
            "vllm-prefill-dp2-nodes1", "decode-2", 1, "VLLM_NIXL_SIDE_CHANNEL_PORT", "14001",
            ["NIXL side channel", "127.0.0.1:14002"], id="a side channel shared across instances",
        ),
        pytest.param(  # the master's host, not its own
            "vllm-decode-dp2-nodes2", "decode-1", 3, "VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1",
            ["is not the engine's host"], id="a side channel on another host",
        ),
        pytest.param(
            "vllm-union-dp2-nodes2", "union-1", 3, "--node-rank", "1",
            ["--node-rank values repeat"], id="a repeated vLLM node rank",
        ),
        pytest.param(
            "sglang-union-dp2-nodes1", "union-1", 0, "--dp-size", "2",
            ["3 DP schedulers on 127.0.0.1"], id="SGLang schedulers beyond the ranks of a host",
        ),
        pytest.param(  # rank 0's rendezvous, not rank 1's
            "sglang-decode-dp2-nodes2", "decode-1", 3, "--dist-init-addr", "127.0.0.1:16000",
            ["rank 1's parts do not meet"], id="SGLang parts of a rank that do not meet",
        ),
        pytest.param(
            "sglang-prefill-dp1-nodes2", "prefill-1", 1, "--disaggregation-bootstrap-port", "10003",
            ["--disaggregation-bootstrap-port"], id="an SGLang bootstrap port off the head",
        ),
        pytest.param(  # rank 0's rendezvous, not rank 1's
            "vllm-dense-union-dp2-nodes2", "union-1", 3, "--master-port", "16000",
            ["rank 1's parts do not meet"], id="a dense part meeting at another rank's head",
        ),
    ],
)  # fmt: skip
def test_a_broken_launch_is_caught(
    case: str, instance: str, rank: int, key: str, value: str, complaint: list[str]
) -> None:
    """One flag (``--...``) or environment variable of one engine changed: the invariants say so."""
    launches, x = broken(case, instance, rank)
    if key.startswith("--"):
        set_flag(x, key, value)
    else:
        x["env"][key] = value
    problems = invariants.check(launches)
    assert any(all(c in p for c in complaint) for p in problems), problems


def test_a_rank_whose_shards_do_not_split_over_its_nodes_is_caught() -> None:
    # Both engines refuse it (vLLM: "--nnodes 4 must evenly divide the total world size (2)";
    # SGLang: "tp_size must be divisible by number of nodes").
    for case, flag in (
        ("vllm-prefill-dp2-nodes2", "--tensor-parallel-size"),
        ("sglang-prefill-dp1-nodes2", "--tp-size"),
    ):
        launches, x = broken(case, "prefill-1", 0)
        set_flag(x, flag, "1")
        assert any("does not split over 2 nodes" in p for p in invariants.check(launches)), case


def test_a_dense_rank_with_a_dp_rank_is_caught() -> None:
    launches, x = broken("vllm-dense-prefill-dp2-nodes1", "prefill-1", 1)
    at = x["argv"].index("--data-parallel-size") + 2
    x["argv"][at:at] = ["--data-parallel-rank", "1"]
    problems = invariants.check(launches)
    assert any("--data-parallel-rank is '1', expected None" in p for p in problems), problems
