"""Property-based fuzzing of the whole API from its own /openapi.json (schemathesis). Part of the
normal suite with 25 fixed examples per operation; a bigger, fresh run:

    TAILSERVE_FUZZ_EXAMPLES=2000 TAILSERVE_FUZZ_RANDOM=1 python -m pytest tests/test_server_schemathesis.py

Every operation gets generated bodies, valid and invalid (both of schemathesis' modes); the one
check is that none is answered with a 5xx. Skipped when schemathesis is not installed
(``pip install schemathesis``). With ``TAILSERVE_FUZZ_REPORT=PATH`` the count of answers by
status is written there as JSON when the module ends.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_helpers import MICRO, running_server
from tailserve.executors.pytorch.init_model import init_model

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (after the skip: hypothesis comes with it)
from schemathesis.checks import not_a_server_error  # noqa: E402

pytestmark = pytest.mark.fuzz
MAX_EXAMPLES = int(os.environ.get("TAILSERVE_FUZZ_EXAMPLES", "25"))
# The default run (part of the normal suite, so CI guards the API) draws the same examples every
# time; TAILSERVE_FUZZ_RANDOM=1 explores new ones.
DERANDOMIZE = os.environ.get("TAILSERVE_FUZZ_RANDOM") != "1"
STATUSES: Counter[str] = Counter()  # "METHOD path status" -> answers


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model: Path = init_model(
        tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO
    )
    # A short context: a body without max_tokens generates the rest of it.
    with running_server(model, "torch", policy_flags={"max_model_len": "64"}) as running:
        yield schemathesis.openapi.from_url(f"{running.base_url}/openapi.json")
    report = os.environ.get("TAILSERVE_FUZZ_REPORT")
    if report:
        total = Counter[int]()
        for key, n in STATUSES.items():
            total[int(key.rsplit(" ", 1)[1])] += n
        summary = {
            "requests": sum(total.values()),
            "by_status": dict(sorted(total.items())),
            "server_errors": sum(n for s, n in total.items() if s >= 500),
            "by_operation": dict(sorted(STATUSES.items())),
        }
        Path(report).write_text(json.dumps(summary, indent=2))


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES, derandomize=DERANDOMIZE, deadline=None, suppress_health_check=list(HealthCheck)
)
def test_no_generated_request_gets_a_server_error(case: Any) -> None:
    response = case.call()
    STATUSES[f"{case.method.upper()} {case.path} {response.status_code}"] += 1
    assert response.status_code < 500, (
        f"{case.method.upper()} {case.path}: {response.status_code} {response.text[:200]}"
    )
    case.validate_response(response, checks=[not_a_server_error])
