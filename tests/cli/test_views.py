"""What ``motor instances`` prints: one row per instance, enum values without their prefixes."""

from __future__ import annotations

import pytest
from motor.v1 import common_pb2

from services.cli import views


def test_instance_rows_spell_roles_and_statuses_short() -> None:
    instance = common_pb2.Instance(
        id=3,
        role=common_pb2.ROLE_PREFILL,
        status=common_pb2.INSTANCE_STATUS_ACTIVE,
        model_name="motor-sim",
        job_name="motor-sim-prefill-0",
        endpoints=[
            common_pb2.Endpoint(
                host="127.0.0.1", port=9000, status=common_pb2.ENDPOINT_STATUS_NORMAL, pid=41
            ),
            common_pb2.Endpoint(
                host="127.0.0.1", port=9002, status=common_pb2.ENDPOINT_STATUS_WAIT_TO_START, headless=True
            ),
        ],
    )
    assert views.instance_rows([instance]) == [
        ["ID", "ROLE", "STATUS", "MODEL", "JOB", "ENDPOINTS"],
        [
            "3",
            "PREFILL",
            "ACTIVE",
            "motor-sim",
            "motor-sim-prefill-0",
            "127.0.0.1:9000(NORMAL,pid=41) 127.0.0.1:9002(WAIT_TO_START,headless)",
        ],
    ]


def test_table_columns_are_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    views.print_table([["ID", "ROLE"], ["12", "DECODE"], ["3", "PREFILL"]])
    assert capsys.readouterr().out == "ID  ROLE\n12  DECODE\n3   PREFILL\n"
