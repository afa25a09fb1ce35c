"""vLLM V1's async scheduling and speculative decoding in the ``vllm`` policy, the engine and the
simulated executor (hand-built cases; the random ones are the differential's,
``python -m benchmarks.differential --engine vllm-async`` / ``vllm-spec``, docs/validation.md)."""

from __future__ import annotations

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated import async_decode_run, decode_run
from tailserve.executors.simulated.cost_model import BatchShape, CostModel
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor, advanced_batch_shape
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.spec_decode import (
    DrafterCost,
    SpecDecoding,
    acceptance_length_to_rates,
    accepted_drafts,
    resolve_acceptance_rates,
)
from tailserve.kv.paged import KVCacheManager
from tailserve.metrics.summary import RequestLatencies
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.validate.tailserve_side import run_tailserve
from tailserve.validate.workload import STOP_TOKEN_ID, RequestSpec, SchedulerSpec, Workload


def _workload(requests: list[RequestSpec], **flags) -> Workload:
    spec = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    return Workload(SchedulerSpec(**(spec | flags)), requests)


def _request(
    rid: str, prompt: int, outputs: list[int], arrival: int = 0, first: int = 100, **kw
) -> RequestSpec:
    return RequestSpec(rid, arrival, list(range(first, first + prompt)), outputs, **kw)


def _grants(steps, rid: str) -> list[tuple[int, int, int]]:
    """(step, new tokens, computed before) of each step that scheduled ``rid``."""
    return [(s.step, n, c) for s in steps for r, n, c in s.scheduled if r == rid]


def _finished_at(steps, rid: str) -> int:
    return next(s.step for s in steps if rid in s.finished)


# ---- async scheduling: decisions --------------------------------------------------------------


def test_async_stop_token_costs_one_extra_step():
    """A request that stops on a stop token is scheduled once more under async scheduling (its
    next step is decided before the stop is known); that step's output is dropped."""
    req = _request("a", 4, [10, STOP_TOKEN_ID, 12, 13, 14])
    sync = run_tailserve(_workload([req]))
    asyn = run_tailserve(_workload([req], async_scheduling=True))
    assert _grants(sync, "a") == [(0, 4, 0), (1, 1, 4)]
    assert _finished_at(sync, "a") == 1
    assert _grants(asyn, "a") == [(0, 4, 0), (1, 1, 4), (2, 1, 5)]  # the third is the extra step
    assert _finished_at(asyn, "a") == 2


def test_async_max_tokens_guard_schedules_no_extra_step():
    """With its last token in flight (``computed + 2 - placeholders >= prompt + max_tokens``) a
    request is skipped, not scheduled again: as many steps as without async scheduling."""
    req = _request("a", 4, [10, 11])
    sync = run_tailserve(_workload([req]))
    asyn = run_tailserve(_workload([req], async_scheduling=True))
    assert [n for _, n, _ in _grants(asyn, "a")] == [n for _, n, _ in _grants(sync, "a")] == [4, 1]
    assert _finished_at(sync, "a") == 1
    assert _finished_at(asyn, "a") == 2  # its outputs arrive a step later
    assert asyn[2].scheduled == []  # step 2 skipped it


def test_async_prefilled_request_decodes_at_once_and_slots_free_a_step_later():
    """A prompt prefilled in step 0 decodes in step 1 on a placeholder (its first token not yet
    known); a finished request's slot and blocks come back one step later, so the next waiting
    request is admitted a step later than without async scheduling."""
    a = _request("a", 4, [10, 11])
    b = _request("b", 4, [20], first=200)
    sync = run_tailserve(_workload([a, b], max_num_seqs=1))
    asyn = run_tailserve(_workload([a, b], max_num_seqs=1, async_scheduling=True))
    assert _grants(asyn, "a")[1] == (1, 1, 4)
    assert sync[2].admitted == ["b"]
    assert asyn[2].admitted == [] and asyn[3].admitted == ["b"]


# ---- speculative decoding: the scheduler's accounting ----------------------------------------


def _spec_flags(method: str = "ngram", k: int = 3, **kw) -> dict:
    return {
        "speculative_method": method,
        "num_speculative_tokens": k,
        "synthetic_acceptance_rates": [0.5] * k,
    } | kw


def test_drafts_count_against_the_budget_and_rejections_roll_back():
    """A decode with k drafts is granted 1 + k tokens out of the budget; the next step starts
    after the accepted ones (1 + accepted tokens sampled, the rejected ones' KV recomputed)."""
    accepted = [2, 0, 3] + [3] * 10  # by position: after 4 computed tokens, 5, ...
    a = _request("a", 4, list(range(10, 20)), accepted=accepted)
    b = _request("b", 4, list(range(30, 40)), first=200, accepted=[3] * 14)
    steps = run_tailserve(_workload([a, b], max_num_batched_tokens=6, **_spec_flags()))
    # Step 0: both prompts (4 + 2 of b's, the budget's 6). Step 1: b's last 2; a has no drafts yet
    # (its prefill step proposes them after it runs).
    assert steps[0].scheduled == [("a", 4, 0), ("b", 2, 0)]
    assert steps[1].scheduled == [("a", 4, 4), ("b", 2, 2)]  # a: 1 + 3 drafts; b's chunk: the rest
    # a verified 3 drafts after 4 computed tokens and accepted 2: 3 tokens sampled, computed 4 + 3.
    assert ("a", 4, 7) in steps[2].scheduled
    # The budget holds 6: b's own verification (1 + 3) cut to the 2 left.
    assert steps[2].scheduled == [("a", 4, 7), ("b", 2, 4)]


def test_a_cut_verification_accepts_only_the_drafts_it_verified():
    """A budget cut to 1 + s < 1 + k tokens verifies s drafts: min(draw, s) accepted."""
    a = _request("a", 4, list(range(10, 22)), accepted=[4] * 20)
    steps = run_tailserve(
        _workload(
            [a],
            max_num_batched_tokens=3,
            max_num_seqs=1,
            **_spec_flags(k=4, synthetic_acceptance_rates=[1.0] * 4),
        )
    )
    # 3-token budget: prompt in 2 chunks (3 + 1), then 1 + 2 drafts each step, all accepted.
    assert [(n, c) for _, n, c in _grants(steps, "a")][:4] == [(3, 0), (1, 3), (3, 4), (3, 7)]


def test_lookahead_slots_are_allocated_for_eagle_not_ngram():
    """EAGLE reserves k lookahead KV slots past the verified tokens; the n-gram drafter none."""
    a = _request("a", 7, [10, 11, 12, 13], accepted=[0] * 10)
    ngram = run_tailserve(_workload([a], enable_prefix_caching=False, **_spec_flags("ngram", 2)))
    eagle = run_tailserve(_workload([a], enable_prefix_caching=False, **_spec_flags("eagle", 2)))
    # Step 0: the 7-token prompt: 2 blocks of 4 with the n-gram drafter, 7 + 2 slots = 3 for EAGLE.
    assert ngram[0].num_used_blocks == 2
    assert eagle[0].num_used_blocks == 3


def test_eagle_prefix_hit_drops_its_last_block():
    """An EAGLE drafter needs the hidden states before the generation point: a prefix hit gives
    up its last cached block (vLLM's ``use_eagle_block_drop``)."""
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks of 4
    first = RequestSpec("a", 0, prompt, [10], accepted=[0] * 4)
    second = RequestSpec("b", 3, prompt, [20], accepted=[0] * 4)
    for method, hit in (("ngram", 12), ("eagle", 8)):
        steps = run_tailserve(_workload([first, second], **_spec_flags(method, 2)))
        admitted = next(s for s in steps if "b" in s.admitted)
        assert ("b", 14 - hit, hit) in admitted.scheduled, method


def test_a_new_decode_is_padded_to_the_uniform_decode_size():
    """A newly scheduled request with one token left (here a one-token prompt beside a running
    decode) is padded to 1 + k with placeholder drafts, which are always rejected."""
    a = _request("a", 4, list(range(10, 20)), accepted=[2] * 14)
    b = _request("b", 1, [30, 31], arrival=2, first=300, accepted=[2] * 6)
    steps = run_tailserve(_workload([a, b], **_spec_flags(k=2, synthetic_acceptance_rates=[1.0, 1.0])))
    step = next(s for s in steps if "b" in s.admitted)
    assert ("b", 3, 0) in step.scheduled
    # Its padding accepted nothing: one token sampled, the next step starts after 1 computed.
    assert ("b", 3, 1) in steps[step.step + 1].scheduled


@pytest.mark.parametrize(
    "flags",
    [
        "async_scheduling=true",
        "speculative_method=eagle3:num_speculative_tokens=3:synthetic_acceptance_length=2.4",
        "async_scheduling=true:speculative_method=mtp:num_speculative_tokens=2:synthetic_acceptance_rates=0.7/0.4",
    ],
)
def test_rollback_and_placeholders_conserve_blocks_under_pressure(flags):
    """Many requests on a small KV cache (preemption with outputs in flight): every request ends
    with exactly its tokens, blocks conserved after every step, nothing left held."""
    import numpy as np

    rng = np.random.default_rng(3)
    requests = [
        Request(
            f"r{i}",
            int(rng.integers(8, 200)),
            int(rng.integers(1, 80)),
            float(t),
            priority=int(rng.integers(0, 3)),
        )
        for i, t in enumerate(np.cumsum(rng.exponential(0.01, 40)))
    ]
    cfg = {k: v for k, v in (part.split("=") for part in flags.split(":"))}
    from tailserve.core.config_flags import convert, field_kinds

    kinds = field_kinds(VllmConfig)
    config = VllmConfig(128, 16, **{k: convert(v, kinds[k]) for k, v in cfg.items()})
    policy = VllmPolicy(config)
    kv = KVCacheManager(96, 16)
    sched = Scheduler(policy, kv, 1024)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    engine = Engine(
        sched,
        SimExecutor(cost, 16, policy.speculative_decoding(), seed=1),
        ListSource(requests),
        options=EngineOptions(check_integrity=True),
    )
    SimDriver(engine).run()
    assert sum(r.num_preemptions for r in requests) > 0
    for r in requests:
        assert r.status.name == "FINISHED_LENGTH"
        assert len(r.token_times) == r.max_tokens
        assert r.num_in_flight_tokens == 0
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.block_tables.values())


# ---- the simulated executor: cost, acceptance, time -------------------------------------------


def test_acceptance_follows_vllms_synthetic_sampler():
    assert acceptance_length_to_rates(2.5, 3) == (1.0, 0.5, 0.0)
    assert resolve_acceptance_rates(2, None, 3.0) == (1.0, 1.0)
    spec = SpecDecoding("eagle", 3, (0.8, 0.5, 0.2))
    draws = [accepted_drafts(spec, 7, f"r{i}", 100) for i in range(20000)]
    # E[accepted] = sum of the unconditional rates; P(accepted >= i) = p_i.
    assert sum(draws) / len(draws) == pytest.approx(1.5, abs=0.03)
    for i, p in enumerate((0.8, 0.5, 0.2), start=1):
        assert sum(d >= i for d in draws) / len(draws) == pytest.approx(p, abs=0.015)
    # Deterministic in (seed, request, position), different across seeds.
    assert [accepted_drafts(spec, 7, "r1", c) for c in range(50)] == [
        accepted_drafts(spec, 7, "r1", c) for c in range(50)
    ]
    assert [accepted_drafts(spec, 7, "r1", c) for c in range(50)] != [
        accepted_drafts(spec, 8, "r1", c) for c in range(50)
    ]


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be >= 0"),
        ({"num_speculative_tokens": 2}, "needs speculative_method"),
        ({"num_speculative_tokens": 2, "speculative_method": "eagle"}, "exactly one of"),
        (
            {
                "num_speculative_tokens": 2,
                "speculative_method": "eagle",
                "synthetic_acceptance_rates": (0.5, 1.5),
            },
            "in [0, 1]",
        ),
        (
            {
                "num_speculative_tokens": 2,
                "speculative_method": "eagle",
                "synthetic_acceptance_rates": (0.4, 0.6),
            },
            "non-increasing",
        ),
        (
            {"num_speculative_tokens": 2, "speculative_method": "eagle", "synthetic_acceptance_length": 3.5},
            "[1, 3]",
        ),
        (
            {
                "num_speculative_tokens": 2,
                "speculative_method": "draft_model",
                "synthetic_acceptance_length": 2,
            },
            "not modelled",
        ),
        (
            {
                "num_speculative_tokens": 2,
                "speculative_method": "ngram",
                "synthetic_acceptance_length": 2,
                "async_scheduling": True,
            },
            "async scheduling is only supported",
        ),
        ({"speculative_method": "eagle"}, "needs num_speculative_tokens >= 1"),
        (
            {
                "num_speculative_tokens": 4,
                "speculative_method": "eagle",
                "synthetic_acceptance_length": 2,
                "long_prefill_token_threshold": 3,
            },
            "below 1 + num_speculative_tokens",
        ),
    ],
)
def test_bad_speculative_flags_are_one_line_errors(flags, message):
    with pytest.raises(ValueError, match=None) as error:
        VllmConfig(256, 8, **flags)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_verification_is_priced_like_a_small_prefill_and_the_drafter_adds_its_layer():
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    decode = BatchShape.of([], [1000] * 8)
    verify = BatchShape(8 * 4, 8 * 4, 8 * (4 * 1000 + 10), 8 * 1004, 0)  # 8 x (1 + 3) after 1000
    assert cost.iteration_time(verify) > cost.iteration_time(decode)
    eagle = DrafterCost(cost, SpecDecoding("eagle3", 3, (0.8, 0.5, 0.2)))
    ngram = DrafterCost(cost, SpecDecoding("ngram", 3, (0.8, 0.5, 0.2)))
    assert ngram.time(verify, 8, 8 * 1004) == 0.0
    drafted = eagle.time(verify, 8, 8 * 1004)
    # k passes of one layer (the LM head each time): the first over the step's tokens, the
    # others one token per drafting request, none with the per-step overhead.
    layer = eagle.layer
    assert layer is not None and layer.model.num_layers == 1 and layer.efficiency.overhead == 0.0
    first = layer.iteration_time(BatchShape(32, 8, verify.prefill_pairs, verify.prefill_kv_tokens, 0))
    later = [layer.iteration_time(BatchShape(8, 8, 0, 0, 8 * 1004 + 8 * j)) for j in (1, 2)]
    assert drafted == pytest.approx(first + sum(later), rel=1e-12)
    assert 0 < drafted < cost.iteration_time(verify)


def test_spec_decode_step_advances_several_tokens_and_itl_counts_steps():
    """Tokens accepted in one step share its time: TPOT falls by the tokens per step, and ITL
    (vLLM's benchmark: one gap per streamed chunk) skips the zero gaps inside a step."""
    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    times = {}
    for name, policy in (
        ("plain", "vllm"),
        ("spec", "vllm:speculative_method=eagle3:num_speculative_tokens=3:synthetic_acceptance_length=4"),
    ):
        request = Request("a", 100, 61, 0.0)
        built_engine = build_engine(built, policy, "sim", source=ListSource([request]))
        SimDriver(built_engine.engine).run()
        times[name] = request.token_times
    assert len(times["spec"]) == len(times["plain"]) == 61
    # All drafts accepted: 4 tokens per step after the first.
    assert len(set(times["spec"])) == 1 + 60 // 4
    lat = RequestLatencies.of([_done(times["spec"])])
    assert len(lat.itl) == 60 // 4 and (lat.itl > 0).all()


def _done(token_times: list[float]) -> Request:
    r = Request("x", 10, len(token_times), 0.0)
    r.token_times = list(token_times)
    r.first_scheduled_time = 0.0
    r.status = r.status.FINISHED_LENGTH
    return r


def test_async_scheduling_hides_the_host_overhead_behind_the_forward_pass():
    """A lone decode: each step takes its forward pass plus the per-step overhead without async
    scheduling; with it, the overhead of one step runs during the previous one's forward pass."""
    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    overhead = built.cost_model.efficiency.overhead
    gaps = {}
    for flag in ("false", "true"):
        request = Request("a", 100, 20, 0.0)
        engine = build_engine(
            built, f"vllm:async_scheduling={flag}", "sim", source=ListSource([request])
        ).engine
        SimDriver(engine).run()
        gaps[flag] = [b - a for a, b in zip(request.token_times, request.token_times[1:])]
    for sync_gap, async_gap in zip(gaps["false"][2:], gaps["true"][2:]):
        assert sync_gap - async_gap == pytest.approx(overhead, rel=1e-6)


def test_same_seed_same_run_and_the_fast_path_declines(monkeypatch):
    """With speculative decoding (async or not) the driver takes no decode run
    (``can_fast_forward`` is False): stepped and fast-forwarded runs are the same steps; the
    same seed gives the same acceptances."""
    calls = []
    original = decode_run.advance_decode_run
    monkeypatch.setattr(decode_run, "advance_decode_run", lambda engine: calls.append(1) or original(engine))
    original_async = async_decode_run.advance_async_decode_run
    monkeypatch.setattr(
        async_decode_run,
        "advance_async_decode_run",
        lambda engine: calls.append(1) or original_async(engine),
    )
    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    policy = "vllm:async_scheduling=true:speculative_method=eagle:num_speculative_tokens=2:synthetic_acceptance_rates=0.6/0.3"

    def run(seed: int, fast: bool) -> list:
        requests = [Request(f"r{i}", 50 + 7 * i, 30 + i, 0.003 * i) for i in range(12)]
        built_engine = build_engine(
            built,
            policy,
            "sim",
            BuildOptions(seed=seed, engine=EngineOptions(fast_forward=fast)),
            source=ListSource(requests),
        )
        SimDriver(built_engine.engine).run()
        return [tuple(r.token_times) for r in requests]

    first = run(1, True)
    assert first == run(1, False) == run(1, True)
    assert first != run(2, True)
    assert not calls


@pytest.mark.parametrize(
    "flag",
    [
        "async_scheduling=true",
        "speculative_method=eagle:num_speculative_tokens=2:synthetic_acceptance_length=2",
    ],
)
def test_realtime_executor_refuses_in_one_line(flag):
    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    with pytest.raises(ValueError) as error:
        build_engine(built, f"vllm:{flag}", "realtime-sim", BuildOptions(vocab_size=100))
    assert "needs the simulated executor" in str(error.value) and "\n" not in str(error.value)


def test_advanced_shape_logits_per_verified_position():
    """A verification samples at each of its 1 + s positions; a partial chunk at none."""
    from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput

    a, b = Request("a", 10, 5, 0.0), Request("b", 10, 5, 0.0)
    out = SchedulerOutput(
        [ScheduledRequest(a, 4, 20, num_spec_tokens=3), ScheduledRequest(b, 6, 0, partial=True)],
        advanced=True,
    )
    shape = advanced_batch_shape(out)
    assert (shape.num_tokens, shape.num_logits) == (10, 4)
    assert shape.prefill_pairs == 4 * 20 + 10 + 6 * 7 // 2 * 1 and shape.decode_kv_tokens == 0


def test_tuned_command_line_spells_the_flags_as_vllm_does():
    from tailserve.policies.registry import parse_policy_list
    from tailserve.tune.commands import command_line

    spec = parse_policy_list(
        "vllm:async_scheduling=true:speculative_method=eagle3:num_speculative_tokens=3:synthetic_acceptance_length=2"
    )[0]
    line = command_line(
        spec, Deployment("Llama-3-8B", "H100-SXM", 1), None, get_hardware("H100-SXM").device_info, 8192
    )
    assert line is not None
    assert line.endswith(
        """--async-scheduling --speculative-config '{"method": "eagle3", "num_speculative_tokens": 3}'"""
    )
    plain = command_line(
        parse_policy_list("vllm")[0],
        Deployment("Llama-3-8B", "H100-SXM", 1),
        None,
        get_hardware("H100-SXM").device_info,
        8192,
    )
    assert plain is not None and "async" not in plain and "speculative" not in plain


def test_moe_data_parallel_ranks_refuse_async_scheduling_in_one_line(capsys):
    """An MoE model's DP ranks step in lockstep by halves (cluster/dp_group.py): async
    scheduling is refused there, in one line."""
    from tailserve.cli import main

    rc = main(
        ["simulate", "--policy", "vllm", "--async-scheduling", "--model", "DeepSeek-V3", "--hardware", "H200",
         "--tp", "4", "--dp", "2", "--workload", "random", "--num-requests", "4", "--rate", "5"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and err[-1].endswith("(an MoE model's data-parallel ranks, --dp)")


# ---- the default: vLLM 0.32's rule (vllm/config/vllm.py:1585-1644, platforms/cpu.py:331) ----


def test_async_scheduling_defaults_to_vllm_032s_rule():
    from tailserve.core.device import DeviceInfo

    gpu = get_hardware("H100-SXM").device_info
    amd = get_hardware("MI300X").device_info
    cpu = DeviceInfo("CPU", 2.0, vendor="cpu")
    on = VllmPolicy.default_config(gpu, 8192)
    assert on.async_scheduling is True and VllmPolicy(on).async_scheduling()
    assert VllmPolicy.default_config(amd, 8192).async_scheduling is True
    assert VllmPolicy.default_notes(gpu, on, {})[0].startswith("async scheduling on: vLLM 0.32's default")
    off = VllmPolicy.default_config(cpu, 8192)
    assert off.async_scheduling is False
    assert "platforms/cpu.py:331" in VllmPolicy.default_notes(cpu, off, {})[0]
    # The CPU n-gram drafter rules it out (vLLM warns and turns it off); the GPU drafters do not.
    spec = {"num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0}
    ngram = VllmPolicy.default_config(gpu, 8192, speculative_method="ngram", **spec)
    assert ngram.async_scheduling is False
    assert "ngram-based speculative decoding" in VllmPolicy.default_notes(gpu, ngram, {})[0]
    for method in ("ngram_gpu", "eagle", "eagle3", "mtp"):
        assert VllmPolicy.default_config(gpu, 8192, speculative_method=method, **spec).async_scheduling
    # An explicit value wins, and says nothing.
    for flag in (False, True):
        config = VllmPolicy.default_config(gpu, 8192, async_scheduling=flag)
        assert config.async_scheduling is flag
        assert VllmPolicy.default_notes(gpu, config, {"async_scheduling": flag}) == []
    assert VllmPolicy.default_config(cpu, 8192, async_scheduling=False).async_scheduling is False
    # A config made by hand (the differential's) without it schedules synchronously.
    assert not VllmPolicy(VllmConfig(2048, 256)).async_scheduling()


def test_a_simulated_gpu_run_is_async_by_default_and_says_so():
    built = build_engine(Deployment("Llama-3-8B", "H100-SXM", 1), "vllm", "sim")
    assert built.scheduler.async_scheduling and built.spec.label == "vllm"
    assert len(built.notes) == 1 and built.notes[0].startswith("async scheduling on")
    sync = build_engine(Deployment("Llama-3-8B", "H100-SXM", 1), "vllm:async_scheduling=false", "sim")
    assert not sync.scheduler.async_scheduling and sync.notes == ()
    # The real-time executor steps synchronously: the default is turned off, and the spec it runs
    # (what a stand-in server reports for bench --predict) says so; asked for, it is refused.
    realtime = build_engine(Deployment("Llama-3-8B", "H100-SXM", 1), "vllm", "realtime-sim")
    assert not realtime.scheduler.async_scheduling
    assert realtime.spec.flags == {"async_scheduling": False}
    assert realtime.notes[0].startswith("async scheduling off: the real-time simulated executor")
    with pytest.raises(ValueError, match="async_scheduling needs the simulated executor"):
        build_engine(Deployment("Llama-3-8B", "H100-SXM", 1), "vllm:async_scheduling=true", "realtime-sim")
    # Policies of engines without an overlapped loop are untouched (SGLang's and TensorRT-LLM's
    # overlap schedulers say so in their own notes: test_sglang_overlap, test_trtllm_overlap).
    for name in ("tgi", "sarathi", "orca"):
        assert build_engine(Deployment("Llama-3-8B", "H100-SXM", 1), name, "sim").notes == ()


def test_moe_data_parallel_ranks_default_to_synchronous_with_a_note(capsys):
    from tailserve.cli import main

    rc = main(
        ["simulate", "--policy", "vllm", "--model", "DeepSeek-V3", "--hardware", "H200",
         "--tp", "4", "--dp", "2", "--workload", "random", "--num-requests", "4", "--rate", "5"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0
    assert "note: async scheduling off: tailserve steps an MoE model's data-parallel ranks in lockstep" in err


@pytest.mark.parametrize(
    ("method", "pooled"), [("mtp", True), ("eagle", True), ("eagle3", True), ("ngram", False), ("ngram_gpu", False)]
)
def test_a_gpu_drafter_shares_the_gpu_memory_and_the_kv_pool(method, pooled):
    """vLLM loads an EAGLE / MTP drafter with the target before it profiles memory, and its
    attention layer gets KV beside the target's: the pool loses one layer's weights and each
    token costs one more layer's KV (1/61 more on DeepSeek-V3). N-gram drafters load nothing."""
    from tailserve.assemble.simulated import policy_kv_capacity
    from tailserve.executors.simulated.spec_decode import draft_layer_weight_bytes
    from tailserve.policies.registry import parse_policy_list

    cost = build_cost_model(Deployment.of("DeepSeek-V3", "h200", 8, "none", quantization="fp8")).cost_model
    device = get_hardware("h200").device_info
    sizes = []
    for text in ("vllm", f"vllm:speculative_method={method}:num_speculative_tokens=2:synthetic_acceptance_length=2"):
        spec = parse_policy_list(text)[0]
        config = VllmPolicy.default_config(device, 4096, **spec.flags)
        sizes.append(policy_kv_capacity(cost, spec, config, 4096))
    plain, drafted = sizes
    if not pooled:
        assert drafted == plain
        return
    model = cost.model
    assert drafted.weights_gib == pytest.approx(plain.weights_gib + draft_layer_weight_bytes(model, 8) / 2**30)
    per_token = model.kv_bytes_per_token(8)
    assert drafted.kv_bytes_per_token == per_token + per_token // model.num_layers
    assert drafted.num_blocks < plain.num_blocks
