"""TensorRT-LLM's ``batch_wait_timeout_ms``: every engine-loop iteration's fetch of new requests
waits up to the timeout for ``max_batch_size`` of them when fewer came
(``ExecutorRequestQueue._get_from_request_queue``; ``Engine._fetch``)."""

from __future__ import annotations

import pytest

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_config import TrtllmConfig


class _Fixed:
    needs_block_ids = False

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def execute(self, out) -> StepResult:
        return StepResult(self.seconds)


def _engine(requests: list[Request], **flags) -> Engine:
    device = get_hardware("H100-SXM").device_info
    config = TrtllmPolicy.default_config(device, 4096, disable_overlap_scheduler=True, **flags)
    sched = Scheduler(TrtllmPolicy(config), KVCacheManager(256, 32), 4096)
    return Engine(sched, _Fixed(0.004), ListSource(requests), options=EngineOptions(check_integrity=True))


def test_every_step_waits_the_timeout_when_fewer_than_max_batch_size_came():
    """One request, a 10 ms timeout: the idle engine blocks for it, then waits 10 ms for more;
    each later step (decodes too) waits 10 ms before it starts."""
    r = Request("a", 64, 4, 1.0)
    engine = _engine([r], batch_wait_timeout_ms=10)
    engine.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.token_times[0] == pytest.approx(1.0 + 0.010 + 0.004)
    assert [b - a for a, b in zip(r.token_times, r.token_times[1:])] == pytest.approx([0.014] * 3)


def test_the_fetch_returns_once_max_batch_size_requests_came():
    """max_batch_size 2: the second arrival, 3 ms after the first, ends the wait at once."""
    a, b = Request("a", 64, 1, 0.0), Request("b", 64, 1, 0.003)
    engine = _engine([a, b], batch_wait_timeout_ms=50, max_batch_size=2)
    engine.run()
    assert a.token_times[0] == pytest.approx(0.003 + 0.004)
    assert b.token_times[0] == pytest.approx(0.003 + 0.004)


def test_no_timeout_no_wait():
    r = Request("a", 64, 3, 0.0)
    engine = _engine([r])
    engine.run()
    assert engine.scheduler.fetch_wait is None
    assert [b - a for a, b in zip(r.token_times, r.token_times[1:])] == pytest.approx([0.004] * 2)


def test_a_negative_timeout_is_refused():
    with pytest.raises(ValueError, match="batch_wait_timeout_ms must be >= 0"):
        TrtllmConfig(batch_wait_timeout_ms=-1)


def test_lint_simulates_it_and_the_simulated_run_waits():
    from tailserve.engines.flag_spec import SCHEDULING
    from tailserve.engines.lint import lint

    line = "trtllm-serve meta-llama/Llama-3.1-8B-Instruct --extra_llm_api_options CFG"
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "cfg.yaml")
        with open(cfg, "w") as f:
            f.write("batch_wait_timeout_ms: 5\n")
        rows = {r.name: r for r in lint(line.replace("CFG", cfg)).rows}
    assert rows["batch_wait_timeout_ms"].verdict == SCHEDULING


def test_the_simulator_steps_every_step_under_a_fetch_wait():
    from tailserve.assemble.build import build_engine
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.executors.simulated.driver import SimDriver

    def run(ms: float) -> list[float]:
        built = build_engine(
            Deployment("Llama-3-8B", "H100-SXM", 1, "none"), f"trtllm:batch_wait_timeout_ms={ms}"
        )
        requests = [Request(f"r{i}", 300 + 20 * i, 40, 0.05 * i) for i in range(20)]
        engine = built.make_engine(ListSource(requests), options=EngineOptions(check_integrity=True))
        SimDriver(engine).run()
        return [r.token_times[-1] - r.token_times[0] for r in requests]

    plain, waited = run(0), run(5)
    # 39 decode steps each, 5 ms each waited (the overlap scheduler hides part of it)
    assert all(w > p for p, w in zip(plain, waited))


def test_explain_names_the_fetch_wait(capsys):
    from tailserve.cli.app import main

    argv = ["simulate", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "1", "--workload", "chat"]
    argv += [
        "--num-requests",
        "60",
        "--rate",
        "20",
        "--policy",
        "trtllm:batch_wait_timeout_ms=10",
        "--explain",
    ]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "`batch_wait_timeout_ms: 10` made every step's request fetch wait up to 10 ms" in out


def test_a_pd_prefill_side_with_the_fetch_wait_loses_no_request(capsys):
    """The lockstep P/D pair asks each side when it next has work (Engine.next_wake): a fetch
    stopped at the pair's next event must say its deadline, or the prefill side was never
    stepped again (300 chat requests at 20/s lost chat-299)."""
    from tailserve.cli.app import main

    argv = ["simulate", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--tp", "1", "--workload", "chat"]
    argv += ["--num-requests", "300", "--rate", "20", "--prefill-replicas", "1", "--decode-replicas", "1"]
    argv += ["--prefill-policy", "trtllm:batch_wait_timeout_ms=5", "--decode-policy", "vllm"]
    assert main(argv) == 0
    assert "never left the pair" not in capsys.readouterr().err


def test_a_wall_clock_engine_refuses_the_fetch_wait():
    from tailserve.core.engine import WallClock

    device = get_hardware("H100-SXM").device_info
    config = TrtllmPolicy.default_config(
        device, 4096, batch_wait_timeout_ms=5, disable_overlap_scheduler=True
    )
    sched = Scheduler(TrtllmPolicy(config), KVCacheManager(256, 32), 4096)
    with pytest.raises(ValueError, match="batch_wait_timeout_ms is simulated in virtual time only"):
        Engine(sched, _Fixed(0.004), ListSource([]), WallClock())
