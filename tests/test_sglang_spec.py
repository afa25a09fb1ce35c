"""SGLang 0.5.23's speculative decoding (EAGLE / EAGLE3 / NEXTN, topk 1) in the ``sglang`` policy,
the scheduler's update and the simulated executor (``policies/sglang_spec.py``).

Hand-worked cases on a page-size-1 KV pool: with ``speculative_num_steps`` 3 a decode verifies 4
tokens and makes a request hold ``committed + 2 x 4 = committed + 8`` slots; 1 + the accepted
drafts become outputs. The whole runs use the simulated executor with integrity checks."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import running_request as _running
from helpers import scheduler_for
from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor, batch_shape
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.executors.simulated.spec_decode import accepted_drafts
from tailserve.policies.sglang import ABORT_REASON, SglangConfig, SglangPolicy
from tailserve.policies.sglang_spec import resolve_speculative

NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3, "synthetic_acceptance_length": 2.5}


def _sglang(num_blocks: int, **cfg) -> Scheduler:
    return scheduler_for(SglangPolicy(SglangConfig(**cfg)), num_blocks, 1, 4096)


def _add(sched: Scheduler, rid: str, prompt: int, max_tokens: int) -> Request:
    request = Request(rid, prompt, max_tokens, 0.0)
    assert sched.add_request(request, 0.0)
    return request




def _step(sched: Scheduler, accepted: dict[str, int] | None = None, now: float = 0.0) -> SchedulerOutput:
    out = sched.schedule(now)
    sched.update(out, StepResult(duration=0.01, num_accepted=accepted), now + 0.01)
    return out


# ---- slots reserved per decode, tokens per step -------------------------------------------------


def test_a_decode_verifies_steps_plus_one_and_holds_twice_that_past_the_committed_tokens():
    sched = _sglang(1000, disable_radix_cache=True, **NEXTN)
    kv = sched.kv_cache
    a = _add(sched, "a", 10, 20)
    assert _grants(_step(sched)) == [("a", 10, 0)]  # the prefill is unchanged
    assert kv.num_held("a") == 10 and a.num_output_tokens == 1

    out = _step(sched, {"a": 2})
    assert _grants(out) == [("a", 4, 10)]  # the last sampled token + 3 drafts
    assert out.scheduled[0].num_spec_tokens == 3
    assert kv.num_held("a") == 10 + 8  # committed + 2 x (steps + 1)
    # 1 + 2 accepted: three outputs at one time, their KV committed.
    assert a.num_output_tokens == 4 and a.num_computed_tokens == 13
    assert a.token_times[-3:] == [0.01, 0.01, 0.01]

    out = _step(sched, {"a": 0})
    assert _grants(out) == [("a", 4, 13)]
    assert kv.num_held("a") == 13 + 8  # grew by the 3 the last verification committed
    assert a.num_output_tokens == 5 and a.num_computed_tokens == 14

    _step(sched, {"a": 3})
    assert kv.num_held("a") == 14 + 8  # grew by the 1 the last verification committed
    assert a.num_output_tokens == 9 and a.num_computed_tokens == 18
    _step(sched, {"a": 0})
    assert kv.num_held("a") == 18 + 8


def test_accepted_tokens_stop_at_max_tokens_and_every_slot_is_freed():
    sched = _sglang(100, disable_radix_cache=True, **NEXTN)
    a = _add(sched, "a", 6, 3)
    _step(sched)
    _step(sched, {"a": 3})  # 4 offered, 2 left to generate
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 3 and len(a.token_times) == 3
    assert a.num_computed_tokens == 6 + 3 - 1
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_a_finished_request_caches_only_its_committed_tokens_in_the_radix_tree():
    sched = _sglang(100, **NEXTN)
    a = Request("a", 6, 5, 0.0, prompt_token_ids=list(range(6)))
    assert sched.add_request(a, 0.0)
    _step(sched)
    _step(sched, {"a": 3})
    _step(sched, {"a": 0})  # 1 + 4 + 1 = 6 outputs offered, 5 kept
    assert a.status is RequestStatus.FINISHED_LENGTH
    kv = sched.kv_cache
    policy: SglangPolicy = sched.policy
    kv.check_integrity()
    assert kv.num_free_blocks + policy.tree.evictable_size == kv.num_blocks  # no over-allocation kept


def test_running_cap_defaults_to_48_with_speculative_decoding():
    assert _sglang(1000, **NEXTN).policy.max_running_requests(_sglang(1000, **NEXTN)) == 48
    capped = _sglang(1000, max_running_requests=5, **NEXTN)
    assert capped.policy.max_running_requests(capped) == 5
    plain = _sglang(1000)
    assert plain.policy.max_running_requests(plain) == 500  # auto: num_kv_tokens // 2


# ---- budgets, retraction -----------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "admitted"), [(False, True), (True, False)])
def test_the_admission_budget_sees_the_slots_decodes_hold_ahead(spec, admitted):
    """The PrefillAdder's budget is the plain one (free slots - running reservations), but the
    free slots exclude what speculative decodes hold ahead of their verified tokens."""
    sched = _sglang(40, disable_radix_cache=True, **(NEXTN if spec else {}))
    _add(sched, "a", 10, 4)
    _step(sched)  # a: prefill, 1 output
    _step(sched, {"a": 0})  # a: a decode (spec: 10 + 8 slots held)
    held = sched.kv_cache.num_held("a")
    assert held == (18 if spec else 11)
    policy: SglangPolicy = sched.policy
    # b needs 16 + 5 + 1 page = 22 < free - a's reservation (4 - 2 outputs) x ratio (~1.4).
    reserved = 2 * policy.new_token_ratio
    assert (40 - held - reserved > 22) is admitted
    _add(sched, "b", 16, 5)
    out = sched.schedule(1.0)
    assert (_ids(s.request for s in out.scheduled) == ["b"]) is admitted
    assert policy.batch_is_full is not admitted  # NO_TOKEN


def test_retraction_makes_room_for_the_speculative_reserve():
    """Free 16; a, b and c each need 8 slots past their committed tokens (24): retract in
    SGLang's order (fewest outputs, then longest prompt, first) until the rest fit."""
    sched = _sglang(30, disable_radix_cache=True, **NEXTN)
    a = _running(sched, "a", 5, 3, 50)  # holds 7
    b = _running(sched, "b", 4, 1, 50)  # holds 4
    c = _running(sched, "c", 2, 2, 50)  # holds 3
    assert sched.kv_cache.num_free_blocks == 16
    out = sched.schedule(1.0)
    assert _ids(out.preempted) == ["b"]  # 20 free for a and c's 16
    assert _grants(out) == [("a", 4, 7), ("c", 4, 3)]
    assert b.status is RequestStatus.PREEMPTED and _ids(sched.waiting) == ["b"]
    assert sched.kv_cache.num_held("a") == 15 and sched.kv_cache.num_held("c") == 11
    assert a.num_preemptions == c.num_preemptions == 0

    plain = _sglang(30, disable_radix_cache=True)
    for rid, prompt, outputs in (("a", 5, 3), ("b", 4, 1), ("c", 2, 2)):
        _running(plain, rid, prompt, outputs, 50)
    assert plain.schedule(1.0).preempted == []  # one slot each fits


def test_the_last_request_is_aborted_when_it_cannot_hold_the_reserve():
    """SGLang's ``check_decode_mem`` asks for the whole reserve, so a lone request that cannot
    hold 8 slots past its committed tokens is aborted, though one more token would fit."""
    sched = _sglang(12, disable_radix_cache=True, **NEXTN)
    a = _running(sched, "a", 5, 1, 50)  # holds 5, needs 13
    sched.schedule(1.0)
    assert a.status is RequestStatus.FINISHED_ABORTED and a.status_reason == ABORT_REASON
    assert sched.kv_cache.num_free_blocks == 12


# ---- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "NEXTN", "speculative_eagle_topk": 4, "synthetic_acceptance_length": 2}, "speculative_eagle_topk must be 1"),
        ({"speculative_algorithm": "NGRAM", "synthetic_acceptance_length": 2}, "NGRAM is not modelled"),
        ({"speculative_algorithm": "MEDUSA", "synthetic_acceptance_length": 2}, "must be one of EAGLE, EAGLE3, NEXTN"),
        ({"speculative_num_steps": 3}, "speculative_num_steps needs speculative_algorithm"),
        ({"synthetic_acceptance_length": 2.0}, "synthetic_acceptance_length needs speculative_algorithm"),
        ({"speculative_algorithm": "EAGLE"}, "exactly one of synthetic_acceptance_rates"),
        ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "synthetic_acceptance_rates": (0.9,)}, "must have num_speculative_tokens"),
        ({"speculative_algorithm": "EAGLE3", "synthetic_acceptance_length": 5.0}, r"in \[1, 4\]"),
        ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 0, "synthetic_acceptance_length": 1}, "speculative_num_steps must be >= 1"),
        ({"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 4, "synthetic_acceptance_length": 2}, "needs speculative_num_steps"),
        ({"speculative_algorithm": "EAGLE", "enable_mixed_chunk": True, "synthetic_acceptance_length": 2}, "enable_mixed_chunk"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        SglangConfig(**flags)


def test_auto_params_and_the_draft_token_override_note():
    spec = resolve_speculative("EAGLE3", None, None, 2.0)
    assert spec is not None
    assert (spec.num_steps, spec.num_draft_tokens, spec.decode_reserve) == (3, 4, 8)  # SGLang's (3, 1, 4)
    assert spec.spec.method == "eagle3" and spec.spec.num_speculative_tokens == 3
    assert resolve_speculative("NEXTN", 2, (0.8, 0.5), None).spec.method == "mtp"
    device = get_hardware("H200").device_info
    cfg = SglangPolicy.default_config(device, 4096, speculative_num_draft_tokens=8, **NEXTN)
    notes = SglangPolicy.default_notes(device, cfg, {})
    assert any("max_running_requests is reset to 48" in n for n in notes)
    assert any("adjusted to speculative_num_steps + 1 = 4" in n for n in notes)
    plain = SglangPolicy.default_notes(device, SglangPolicy.default_config(device, 4096), {})
    assert [n for n in plain if "overlap scheduler" not in n] == []  # no speculative notes


# ---- the simulated executor --------------------------------------------------------------------


def test_the_executor_prices_a_verify_and_draws_acceptance_per_request():
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    spec = resolve_speculative("EAGLE", 3, None, 2.5)
    assert spec is not None
    a = Request("a", 100, 50, 0.0)
    a.num_output_tokens, a.num_computed_tokens = 5, 104
    out = SchedulerOutput([ScheduledRequest(a, 4, 104, num_spec_tokens=3)])
    shape = batch_shape(out)
    assert (shape.num_tokens, shape.num_logits, shape.num_prefills, shape.num_decodes) == (4, 4, 0, 0)
    plain = SimExecutor(cost, 1).execute(out)
    result = SimExecutor(cost, 1, spec.spec, seed=7).execute(out)
    assert result.num_accepted == {"a": accepted_drafts(spec.spec, 7, "a", 104)}
    assert result.duration > plain.duration  # the drafter's passes


def _workload(n: int, seed: int, tokens: bool = False) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [[int(t) for t in rng.integers(0, 30000, 200)] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt = int(rng.integers(20, 400))
        ids = (prefixes[i % 3] + [int(t) for t in rng.integers(0, 30000, prompt)]) if tokens else None
        length = len(ids) if ids else prompt
        requests.append(Request(f"r{i}", length, int(rng.integers(5, 300)), i * 0.01, prompt_token_ids=ids))
    return requests


@pytest.mark.parametrize(
    ("flags", "tokens"),
    [
        (NEXTN, False),
        ({**NEXTN, "chunked_prefill_size": 64, "schedule_policy": "lof"}, False),
        (
            {
                "speculative_algorithm": "EAGLE3",
                "speculative_num_steps": 2,
                "synthetic_acceptance_rates": (0.8, 0.5),
            },
            True,
        ),
    ],
)
def test_whole_runs_finish_conserve_blocks_and_advance_by_the_acceptance(flags, tokens):
    """Under KV pressure (retractions), with and without the radix tree: every request leaves
    with all its tokens, the pool is whole, and outputs per verification match the acceptance
    model's mean (1 + sum of the rates)."""
    results = []
    for fast in (True, False):
        sched = _sglang(1000, **flags)
        policy: SglangPolicy = sched.policy
        spec = policy.speculative_decoding()
        executor = SimExecutor(
            CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1), 1, spec, seed=3
        )
        engine = Engine(
            sched, executor, ListSource(_workload(40, 1, tokens)), options=EngineOptions(fast, True)
        )
        SimDriver(engine).run()
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in engine.requests)
        assert all(len(r.token_times) == r.max_tokens for r in engine.requests)
        assert sched.num_preemptions > 0
        kv = sched.kv_cache
        cached = policy.tree.evictable_size if policy.tree is not None else 0
        assert kv.num_free_blocks + cached == kv.num_blocks
        verifies = sum(engine.log.num_decode_tokens) / (spec.num_speculative_tokens + 1)
        # Every prefill that completes (admission, or recompute after a retraction) samples one.
        prefilled = len(engine.requests) + sched.num_preemptions
        outputs = sum(r.num_output_tokens for r in engine.requests) - prefilled
        assert outputs / verifies == pytest.approx(1 + sum(spec.acceptance_rates), rel=0.05)
        results.append([tuple(r.token_times) for r in engine.requests])
    assert results[0] == results[1]  # no fast path with drafts: the same iterations


def test_the_rendered_launch_line_uses_sglangs_own_flags_and_reads_back():
    from tailserve.engines.lint import lint
    from tailserve.engines.translate import translate
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.policies.registry import parse_policy_list
    from tailserve.tune.commands import command_line

    dep = Deployment.of("DeepSeek-V3", "h200", 8, "none", quantization="fp8")
    device = get_hardware("h200").device_info
    spec = parse_policy_list("sglang:speculative_algorithm=NEXTN:synthetic_acceptance_length=2.8")[0]
    line = command_line(spec, dep, None, device, 4096)
    assert line is not None and line.startswith("python -m sglang.launch_server")
    assert (
        "--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4"
    ) in line
    report = lint(line)
    assert not report.refused and not report.unread
    # No engine flag carries the acceptance: SGLang's own simulated acceptance does.
    with pytest.raises(ValueError, match="SGLANG_SIMULATE_ACC_LEN=L"):
        translate(report, device)
    flags = translate(lint(f"SGLANG_SIMULATE_ACC_LEN=2.8 {line}"), device).spec.flags
    assert flags["speculative_algorithm"] == "NEXTN" and flags["speculative_num_steps"] == 3
    assert flags["speculative_eagle_topk"] == 1 and flags["speculative_num_draft_tokens"] == 4
    assert flags["synthetic_acceptance_length"] == 2.8
    SglangConfig(**flags)  # a config the policy takes


def test_the_draft_layer_shares_the_gpu_memory_and_the_kv_pool():
    """SGLang loads the draft layer before it sizes the pool and gives it KV for every token:
    the pool loses one layer's weights (embedding and LM head shared) and each token costs one
    more layer's KV (1/61 more on DeepSeek-V3)."""
    from tailserve.assemble.simulated import policy_kv_capacity
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model
    from tailserve.executors.simulated.drafter_memory import DrafterMemory
    from tailserve.executors.simulated.kv_capacity import kv_capacity
    from tailserve.executors.simulated.spec_decode import draft_layer_weight_bytes
    from tailserve.policies.registry import parse_policy_list

    cost = build_cost_model(Deployment.of("DeepSeek-V3", "h200", 8, "none", quantization="fp8")).cost_model
    device = get_hardware("h200").device_info
    sizes = {}
    for text in ("sglang", "sglang:speculative_algorithm=NEXTN:synthetic_acceptance_length=2.8"):
        spec = parse_policy_list(text)[0]
        config = SglangPolicy.default_config(device, 4096, **spec.flags)
        sizes[text] = policy_kv_capacity(cost, spec, config, 4096)
    plain, drafted = sizes.values()
    model = cost.model
    layer = draft_layer_weight_bytes(model, 8)
    assert 1.2 < layer / 2**30 < 1.5  # one MoE layer at fp8 over 8 GPUs
    assert drafted.weights_gib == pytest.approx(plain.weights_gib + layer / 2**30)
    per_token = model.kv_bytes_per_token(8)
    assert drafted.kv_bytes_per_token == per_token + per_token // model.num_layers
    expected = kv_capacity(
        model, cost.hardware, 8, 0.83, 1, 8192, 48, 1,
        drafter=DrafterMemory(1, 1)
    )
    assert drafted.num_blocks == expected.num_blocks < plain.num_blocks
    assert SglangPolicy.drafter_memory(SglangConfig()) is None


def test_the_realtime_executor_refuses_speculative_decoding_in_one_line():
    from tailserve.assemble import BuildOptions, build_engine
    from tailserve.executors.simulated.deployment import Deployment, build_cost_model

    built = build_cost_model(Deployment("Llama-3-8B", "H100-SXM", 1, "none"))
    policy = "sglang:speculative_algorithm=EAGLE3:synthetic_acceptance_length=2"
    with pytest.raises(ValueError, match="does not do speculative decoding") as error:
        build_engine(built, policy, "realtime-sim", BuildOptions(vocab_size=100))
    assert "\n" not in str(error.value)
