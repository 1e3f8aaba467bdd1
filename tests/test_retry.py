"""Retrying as its callers see it: the delays a Backoff hands out, which failures a RetryPolicy
lets through, and what ``RpcFailure.of`` reads from an error a real gRPC server sent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from motor_mesh.common import errors, retry, rpc
from motor_mesh.common.retry import Backoff, RetryPolicy
from motor_mesh.gen.motor.v1 import controller_pb2, controller_pb2_grpc

DEFAULT_POLICY = RetryPolicy()  # the classifier every call site starts from

Code = grpc.StatusCode
CONTROLLER = controller_pb2.DESCRIPTOR.services_by_name["Controller"]

# --- Backoff -------------------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_maximum() -> None:
    backoff = Backoff(initial=0.2, maximum=2.0, jitter=0)
    assert [backoff.next() for _ in range(7)] == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])


def test_backoff_follows_its_multiplier() -> None:
    backoff = Backoff(initial=1.0, maximum=100.0, multiplier=3, jitter=0)
    assert [backoff.next() for _ in range(4)] == pytest.approx([1.0, 3.0, 9.0, 27.0])


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(initial=1.0, maximum=10.0, jitter=0)
    for _ in range(5):
        backoff.next()
    backoff.reset()
    assert [backoff.next(), backoff.next()] == pytest.approx([1.0, 2.0])


def test_jitter_spreads_each_delay_within_its_bounds() -> None:
    delays = []
    for _ in range(200):
        backoff = Backoff(initial=1.0, maximum=30.0)  # default jitter: 20% either way
        delays.append((backoff.next(), backoff.next()))
    firsts, seconds = [d[0] for d in delays], [d[1] for d in delays]
    assert all(0.8 <= d <= 1.2 for d in firsts)
    assert all(1.6 <= d <= 2.4 for d in seconds)
    assert len(set(firsts)) > 1  # spread, not one fixed value


def test_capped_delays_are_spread_around_the_maximum() -> None:
    backoff = Backoff(initial=1.0, maximum=10.0, jitter=0.5)
    for _ in range(4):  # 1, 2, 4, 8: the cap is reached next
        backoff.next()
    assert all(5.0 <= backoff.next() <= 15.0 for _ in range(100))


def test_a_servers_wait_lengthens_a_delay_up_to_the_maximum_only() -> None:
    backoff = Backoff(initial=1.0, maximum=10.0, jitter=0)
    # Longer than the backoff's own: waited. Shorter, or none: the backoff's own.
    assert [backoff.next(3.0), backoff.next(0.5), backoff.next(None)] == pytest.approx([3.0, 2.0, 4.0])
    assert backoff.next(3600.0) == pytest.approx(10.0)  # a server asking for an hour gets the cap


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoff_refuses_impossible_bounds(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError):
        Backoff(initial=initial, maximum=maximum)


async def test_sleep_returns_each_delay_it_waited() -> None:
    backoff = Backoff(initial=0.01, maximum=0.02, jitter=0)
    assert [await backoff.sleep(), await backoff.sleep()] == pytest.approx([0.01, 0.02])


# --- RetryPolicy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED, Code.INTERNAL, Code.ABORTED],
)
def test_default_policy_retries_transient_failures(code: grpc.StatusCode) -> None:
    assert DEFAULT_POLICY.retryable(code)


@pytest.mark.parametrize(
    "code",
    [
        Code.INVALID_ARGUMENT,
        Code.FAILED_PRECONDITION,
        Code.NOT_FOUND,
        Code.ALREADY_EXISTS,
        Code.UNAUTHENTICATED,
        Code.PERMISSION_DENIED,
        Code.UNIMPLEMENTED,
    ],
)
def test_default_policy_gives_up_on_requests_that_cannot_succeed(code: grpc.StatusCode) -> None:
    assert not DEFAULT_POLICY.retryable(code)


@pytest.mark.parametrize("code", [Code.OK, None])
def test_success_or_no_status_is_never_retried(code: grpc.StatusCode | None) -> None:
    assert not DEFAULT_POLICY.retryable(code)


def test_a_narrowed_policy_retries_everything_but_its_terminal_codes() -> None:
    refusals = {Code.INVALID_ARGUMENT, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED}
    narrowed = retry.policy(refusals)
    assert all(not narrowed.retryable(code) for code in refusals)
    for code in (Code.ALREADY_EXISTS, Code.CANCELLED, Code.FAILED_PRECONDITION, Code.UNAVAILABLE):
        assert narrowed.retryable(code), code


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# --- errors a real server sends ------------------------------------------------------------------


class FailingController(controller_pb2_grpc.ControllerServicer):
    """Register fails with the error its request's job_name names."""

    ERRORS = {
        "info": errors.error_info(Code.ABORTED, "RELAUNCH_IN_PROGRESS", "a relaunch is already running"),
        "stale": errors.precondition("STALE_SESSION", "node/7", "session 3 is stale"),
        "busy": errors.unavailable("controller starting", retry_after_s=2.5),
    }

    async def Register(
        self, request: controller_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.RegisterResponse:
        raise self.ERRORS[request.job_name]


@pytest.fixture
async def controller() -> AsyncIterator[controller_pb2_grpc.ControllerAsyncStub]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((rpc.service_handler(CONTROLLER, FailingController()),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield controller_pb2_grpc.ControllerStub(channel)
    finally:
        await server.stop(None)


async def register_error(stub: controller_pb2_grpc.ControllerAsyncStub, job: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Register(controller_pb2.RegisterRequest(job_name=job), timeout=5)
    return exc.value


async def test_rpc_failure_reads_an_error_info_reason(
    controller: controller_pb2_grpc.ControllerAsyncStub,
) -> None:
    failure = errors.RpcFailure.of(await register_error(controller, "info"))
    assert (failure.code, failure.reason, failure.retry_after) == (Code.ABORTED, "RELAUNCH_IN_PROGRESS", None)
    assert failure.message == "a relaunch is already running"
    assert str(failure) == "ABORTED: a relaunch is already running"


async def test_rpc_failure_reads_a_precondition_failure_type(
    controller: controller_pb2_grpc.ControllerAsyncStub,
) -> None:
    err = await register_error(controller, "stale")
    failure = errors.RpcFailure.of(err)
    assert (failure.code, failure.reason, failure.message) == (
        Code.FAILED_PRECONDITION,
        "STALE_SESSION",
        "session 3 is stale",
    )
    assert not DEFAULT_POLICY.retryable(failure.code)


async def test_rpc_failure_reads_retry_info(controller: controller_pb2_grpc.ControllerAsyncStub) -> None:
    err = await register_error(controller, "busy")
    failure = errors.RpcFailure.of(err)
    assert (failure.code, failure.reason, failure.retry_after) == (Code.UNAVAILABLE, "", 2.5)
    assert DEFAULT_POLICY.retryable(failure.code)


def test_rpc_failure_of_an_error_without_details() -> None:
    failure = errors.RpcFailure.of(rpc_error(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert (failure.code, failure.message, failure.reason, failure.retry_after) == (
        Code.DEADLINE_EXCEEDED,
        "Deadline Exceeded",
        "",
        None,
    )
