"""One motor.v1.NodeManager gRPC server answering for many fake nodes (all register the same
``nm_port``; ``StartEngines`` finds its node by ``job_name``, unique per node).

The Controller probes ``GetStatus`` before assembly and sends ``StartEngines`` after it: this
server answers both at once, so assembly completes without any engine.
"""

from __future__ import annotations

import grpc

from bench.loadgen.harness import rpc_handlers
from bench.loadgen.node import FakeNode
from motor_mesh.gen.motor.v1 import nodemanager_pb2


class FakeNodeManagers:
    def __init__(self) -> None:
        self.nodes: dict[str, FakeNode] = {}
        self.server: grpc.aio.Server | None = None
        self.port = 0

    def add(self, node: FakeNode) -> None:
        self.nodes[node.spec.job_name] = node

    async def start(self, host: str = "127.0.0.1") -> int:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self._handlers(),))
        self.port = server.add_insecure_port(f"{host}:0")
        await server.start()
        self.server = server
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)

    def _handlers(self) -> grpc.GenericRpcHandler:
        """GetStatus and StartEngines only: the rest answer UNIMPLEMENTED."""
        pb = nodemanager_pb2
        return rpc_handlers(
            "motor.v1.NodeManager",
            {
                "GetStatus": (self.GetStatus, pb.GetStatusRequest, pb.GetStatusResponse),
                "StartEngines": (self.StartEngines, pb.StartEnginesRequest, pb.StartEnginesResponse),
            },
        )

    async def GetStatus(
        self, request: nodemanager_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.GetStatusResponse:
        return nodemanager_pb2.GetStatusResponse(ready=True)

    async def StartEngines(
        self, request: nodemanager_pb2.StartEnginesRequest, context: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.StartEnginesResponse:
        node = self.nodes.get(request.job_name)
        if node is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no fake node for {request.job_name}")
            raise AssertionError("unreachable")
        node.instance_id = request.instance_id
        return nodemanager_pb2.StartEnginesResponse(endpoints=node.start_engines(list(request.endpoints)))
