"""The ``slo`` policy unchanged in ``tailserve serve``: on the real executor (its predictor learns
from measured iterations) and on the stand-in simulator (the cost model), with the tenant taken
from the OpenAI ``user`` field or the ``X-Tenant-Id`` header."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from server_helpers import MICRO, running_server, wait_idle
from tailserve.executors.pytorch.init_model import init_model


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.mark.parametrize("executor", ["torch", "sim"])
def test_slo_with_vtc_serves_and_counts_tenants(micro_model: Path, executor: str) -> None:
    flags = {"fairness": "vtc", "slo_classes": "chat=ttft:2s,tbt:500ms,tenant:alice bulk=ttft:30s,tbt:2s"}
    with running_server(micro_model, executor, policy="slo", policy_flags=flags) as server:
        for i in range(3):
            done = server.client.completions.create(
                model="micro", prompt=f"hello {i}", max_tokens=12, user="alice"
            )
            assert done.choices[0].finish_reason == "length"
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "micro", "prompt": "hi", "max_tokens": 3},
            headers={"X-Tenant-Id": "bob"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        wait_idle(server)
        policy = server.engine.scheduler.policy
        counters = policy.backlog.vtc.counters
        assert set(counters) == {"alice", "bob"} and counters["alice"] > counters["bob"] > 0
        # 3 x 12 + 3 iterations run one at a time: the real executor's predictor has fitted them.
        expected = "cost model" if executor == "sim" else "measured iterations"
        assert expected in policy.predictor.source
