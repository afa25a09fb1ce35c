"""SGLang 0.5.23's overlapped speculative decoding ("spec v2") in the ``sglang`` policy
(``policies/sglang_overlap.py``): the late commit, the KV reserve counted from the committed
length before the verify in flight, which ``max_tokens`` finish is foreseen, retraction, and the
conservation invariants.

Hand-worked on a page-size-1 pool with NEXTN, 3 steps (a verify computes 4 tokens, the reserve
is committed + 8) and an executor that accepts 2 drafts per verify (3 tokens per step), 10 ms a
step of which 2 ms are host time (hidden under overlap)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.factory import make_kv_cache
from tailserve.policies.sglang import SglangPolicy
from tailserve.policies.sglang_config import SglangConfig

NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3, "synthetic_acceptance_length": 2.5}


@dataclass
class FixedAccept:
    """Each step lasts ``duration`` (``host`` of it on the host); every verify accepts
    ``accepted`` of its drafts."""

    accepted: int = 2
    duration: float = 0.010
    host: float = 0.002
    needs_block_ids: bool = False

    def execute(self, out: SchedulerOutput) -> StepResult:
        accepted = {s.request.request_id: self.accepted for s in out.scheduled if s.num_spec_tokens}
        return StepResult(duration=self.duration, host_time=self.host, num_accepted=accepted)


def _engine(requests: list[Request], overlap: bool, num_blocks: int = 4096, **flags) -> Engine:
    config = SglangConfig(
        disable_overlap_schedule=not overlap,
        disable_radix_cache=True,
        chunked_prefill_size=64,
        **NEXTN,
        **flags,
    )
    policy = SglangPolicy(config)
    kv = make_kv_cache(policy.kv_spec(), num_blocks, 1, 0, shares_prefixes=False)
    sched = Scheduler(policy, kv, 4096)
    return Engine(sched, FixedAccept(), ListSource(requests), options=EngineOptions(check_integrity=True))


def _launched(engine: Engine) -> SchedulerOutput | None:
    """The batch the last ``step`` launched (under overlap: still in flight)."""
    if engine.scheduler.async_scheduling:
        return engine.in_flight.out if engine.in_flight is not None else None
    return engine.scheduler.last_output


def _trace(engine: Engine, request: Request, num_steps: int) -> list[tuple[int, tuple, int]]:
    """Per step: the request's KV slots held, its grant in the batch launched (new tokens,
    context), its outputs known once the step returned."""
    rid = request.request_id
    rows = []
    for _ in range(num_steps):
        assert engine.step()
        out = _launched(engine)
        grant = (
            next(
                ((s.num_new_tokens, s.num_context_tokens) for s in out.scheduled if s.request is request), ()
            )
            if out is not None
            else ()
        )
        rows.append((engine.scheduler.kv_cache.num_held(rid), grant, request.num_output_tokens))
    return rows


# ---- the reserve and the late commit ------------------------------------------------------------


def test_the_reserve_counts_from_the_committed_length_before_the_verify_in_flight():
    """Synchronous: each verify starts at the committed length (10, 13, 16, ...) and the slots
    grow to committed + 8 (18, 21, 24, ...). Overlap: the first verify is launched while the
    prefill runs (the prefill's KV is committed at launch: 10 + 8 = 18); the second while the
    first runs, at the advanced position 14 — its 3 accepted tokens are not committed yet, so
    the reserve still counts from 10 (held stays 18: ``eagle_prepare_for_decode``'s
    ``kv_committed_len + 2 x 4``); from then on a request holds one accepted run (3) fewer
    slots than synchronously."""
    a, b = Request("a", 10, 40, 0.0), Request("a", 10, 40, 0.0)
    sync = _trace(_engine([a], overlap=False), a, 5)
    over = _trace(_engine([b], overlap=True), b, 5)
    assert sync == [
        (10, (10, 0), 1),
        (18, (4, 10), 4),
        (21, (4, 13), 7),
        (24, (4, 16), 10),
        (27, (4, 19), 13),
    ]
    assert over == [
        (10, (10, 0), 0),  # the prefill in flight
        (18, (4, 10), 1),  # verify 1 launched before the first token is known
        (18, (4, 14), 4),  # verify 2 launched before verify 1's tokens are: committed still 10
        (21, (4, 17), 7),  # committed 13 (verify 1's 3 tokens) + 8
        (24, (4, 20), 10),
    ]


def test_accepted_tokens_are_committed_a_step_late_and_stamped_when_their_result_comes():
    """Overlap: step 1's host part runs alone (0..2 ms), its forward 2..10 ms; each next forward
    follows back to back (8 ms, its host part hidden). The first token is known at 10 ms, verify
    1's three at 18 ms, verify 2's at 26 ms. Synchronous: 10, 20, 30 ms."""
    sync = _engine([Request("a", 10, 7, 0.0)], overlap=False)
    sync.run()
    over = _engine([Request("a", 10, 7, 0.0)], overlap=True)
    over.run()
    (s,), (o,) = sync.scheduler.finished, over.scheduler.finished
    assert s.token_times == pytest.approx([0.010] + [0.020] * 3 + [0.030] * 3)
    assert o.token_times == pytest.approx([0.010] + [0.018] * 3 + [0.026] * 3)
    assert o.status is RequestStatus.FINISHED_LENGTH and o.num_computed_tokens == 10 + 7 - 1


# ---- finishes by length -------------------------------------------------------------------------


def _verifies(engine: Engine, rid: str) -> int:
    count = 0
    while engine.step():
        out = _launched(engine)
        if out is not None:
            count += sum(1 for s in out.scheduled if s.request.request_id == rid and s.num_spec_tokens)
    return count


@pytest.mark.parametrize(
    ("max_tokens", "sync_verifies", "over_verifies"), [(4, 1, 2), (5, 2, 2), (6, 2, 3), (7, 2, 3)]
)
def test_a_max_tokens_finish_is_foreseen_only_when_the_verify_in_flight_starts_on_the_last_token(
    max_tokens, sync_verifies, over_verifies
):
    """Outputs go 1 (prefill), 4, 7 (3 per verify). Under overlap verify k + 1 is decided while
    verify k runs, from the outputs known before it: ``_reqs_finishing_inflight`` leaves the
    request out only when that verify's first token is the last (known + 1 >= max_tokens). With
    5, verify 3 is decided on 4 known: 4 + 1 >= 5, left out — as many verifies as synchronously.
    With 4, 6 or 7 the in-flight verify's accepted run reaches the limit unforeseen (1 + 1 < 4,
    4 + 1 < 6, 4 + 1 < 7): one more verify runs and its output is dropped; the request still
    ends with exactly max_tokens outputs when the verify before it is processed."""
    sync = _engine([Request("a", 10, max_tokens, 0.0)], overlap=False)
    over = _engine([Request("a", 10, max_tokens, 0.0)], overlap=True)
    assert _verifies(sync, "a") == sync_verifies
    assert _verifies(over, "a") == over_verifies
    for engine in (sync, over):
        (a,) = engine.scheduler.finished
        assert a.status is RequestStatus.FINISHED_LENGTH
        assert a.num_output_tokens == len(a.token_times) == max_tokens
        assert engine.scheduler.kv_cache.num_used_blocks == 0


# ---- retraction ---------------------------------------------------------------------------------


def test_retraction_checks_the_reserve_from_the_committed_length_and_drops_the_verify_in_flight():
    """a (prompt 10, 15 outputs) then b (arriving 1 ms later) share a 40-slot pool; a decode
    makes each hold committed + 8. Synchronous: both verify once (18 + 18 held), then need
    21 + 21 > 40: b (fewest outputs, the later one on ties) is retracted before the second
    verify, with 4 outputs. Overlap: the second verify is decided while the first runs, from
    committed 10 each — 18 + 18 fit, both launched; the third needs 21 + 21: b is retracted
    then, and its second verify, in flight, commits nothing (``req.is_retracted``): b keeps 4
    outputs, not 7, and recomputes prompt + 4 = 14 tokens."""
    runs = {}
    for overlap in (False, True):
        a, b = Request("a", 10, 15, 0.0), Request("b", 10, 15, 0.001)
        engine = _engine([a, b], overlap, num_blocks=40, schedule_conservativeness=0.1)
        steps = []
        while engine.step():
            out = _launched(engine)
            if out is None:
                continue
            kv = engine.scheduler.kv_cache
            steps.append(
                ([s.request.request_id for s in out.scheduled], [r.request_id for r in out.preempted])
            )
            prefills = [
                (s.request.request_id, s.num_new_tokens) for s in out.scheduled if not s.num_spec_tokens
            ]
            if b.num_preemptions:
                assert prefills in ([], [("b", 14)])  # its recompute: prompt + 4 outputs
            if out.preempted:
                assert b.num_output_tokens == 4 and kv.num_held("b") == 0
        assert a.num_output_tokens == b.num_output_tokens == 15 and b.num_preemptions == 1
        assert engine.scheduler.kv_cache.num_used_blocks == 0
        runs[overlap] = steps
    assert runs[False][:4] == [(["a"], []), (["b"], []), (["a", "b"], []), (["a"], ["b"])]
    assert runs[True][:5] == [(["a"], []), (["b"], []), (["a", "b"], []), (["a", "b"], []), (["a"], ["b"])]


def test_a_finish_caches_the_committed_tokens_not_the_verify_in_flight():
    """Radix cache on (prompt and planned outputs keyed), max_tokens 7 (outputs 1, 4, 7): the
    third verify is launched unforeseen and dropped; the request leaves 10 + 7 - 1 computed
    tokens, as synchronously, and the tree keeps exactly those: the in-flight verify's
    positions are not cached and its slots are freed with the rest."""
    for overlap in (False, True):
        config = SglangConfig(disable_overlap_schedule=not overlap, chunked_prefill_size=64, **NEXTN)
        policy = SglangPolicy(config)
        kv = make_kv_cache(policy.kv_spec(), 100, 1, 0, shares_prefixes=True)
        a = Request(
            "a", 10, 7, 0.0, prompt_token_ids=list(range(10)), planned_output_token_ids=list(range(100, 107))
        )
        engine = Engine(
            Scheduler(policy, kv, 4096),
            FixedAccept(),
            ListSource([a]),
            options=EngineOptions(check_integrity=True),
        )
        engine.run()
        assert a.status is RequestStatus.FINISHED_LENGTH and a.num_computed_tokens == 16
        assert policy.tree.evictable_size == 16
        assert kv.num_free_blocks + policy.tree.evictable_size == kv.num_blocks


# ---- conservation -------------------------------------------------------------------------------


def _sim_engine(requests: list[Request], num_blocks: int, **flags) -> Engine:
    config = SglangConfig(disable_overlap_schedule=False, **NEXTN, **flags)
    policy = SglangPolicy(config)
    kv = make_kv_cache(
        policy.kv_spec(), num_blocks, 1, 0, shares_prefixes=any(r.prompt_token_ids for r in requests)
    )
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    executor = SimExecutor(cost, 1, policy.speculative_decoding(), seed=3)
    return Engine(
        Scheduler(policy, kv, 4096),
        executor,
        ListSource(requests),
        options=EngineOptions(check_integrity=True),
    )


@pytest.mark.parametrize("tokens", [False, True])
def test_conservation_under_pressure(tokens):
    """Random load on a small pool (retractions), with and without the radix tree, integrity
    checked after every step: every request leaves with exactly max_tokens outputs at
    non-decreasing times; nothing is held at the end; each verify that commits yields 1 + the
    drafts accepted, so outputs per *committed* verify match the acceptance model while the
    verifies launched include the dropped ones (an accepted run crossing max_tokens unforeseen,
    a retracted request's)."""
    rng = random.Random(11)
    prefix = [rng.randrange(30000) for _ in range(100)]
    requests = []
    for i in range(60):
        n = rng.randint(10, 300)
        ids = prefix + [rng.randrange(30000) for _ in range(n)] if tokens else None
        requests.append(
            Request(f"r{i}", len(ids) if ids else n, rng.randint(2, 200), i * 0.004, prompt_token_ids=ids)
        )
    engine = _sim_engine(requests, 1200, schedule_conservativeness=0.3)
    sched = engine.scheduler
    launched = committed = 0
    while True:
        # The verifies applied by this step: those of a request finished already are dropped,
        # and so are those of a request retracted while they ran (marked partial then).
        applied = engine.in_flight
        pending = (
            [(s, s.request.is_finished) for s in applied.out.scheduled if s.num_spec_tokens]
            if applied
            else []
        )
        if not engine.step():
            break
        committed += sum(1 for s, done in pending if not done and not s.partial)
        flight = engine.in_flight
        if flight is not None:
            launched += sum(1 for s in flight.out.scheduled if s.num_spec_tokens)
    assert not sched.has_unfinished and sched.num_preemptions > 0
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == len(r.token_times) == r.max_tokens
        assert r.token_times == sorted(r.token_times)
    kv = sched.kv_cache
    policy: SglangPolicy = sched.policy
    cached = policy.tree.evictable_size if policy.tree is not None else 0
    assert kv.num_free_blocks + cached == kv.num_blocks and kv.num_used_blocks == cached
    spec = policy.speculative_decoding()
    prefilled = len(requests) + sched.num_preemptions
    outputs = sum(r.num_output_tokens for r in requests) - prefilled
    assert launched > committed > 0
    assert outputs / committed == pytest.approx(1 + sum(spec.acceptance_rates), rel=0.05)


# ---- the default, the note and the launch line --------------------------------------------------


def test_the_run_notes_and_the_launch_line_round_trip_both_modes():
    """A simulated GPU run overlaps speculative decoding (SGLang's default) and says so; the
    launch line ``tune`` writes carries ``--disable-overlap-schedule`` only when it was asked,
    and ``lint`` / ``--engine-cmd`` read each back to the same mode."""
    from tailserve.assemble import BuildOptions, build_engine
    from tailserve.engines.lint import lint
    from tailserve.engines.translate import translate
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.policies.registry import parse_policy_list
    from tailserve.tune.commands import command_line

    dep = Deployment.of("DeepSeek-V3", "h200", 8, "none", quantization="fp8")
    device = get_hardware("h200").device_info
    text = "sglang:speculative_algorithm=NEXTN:speculative_num_steps=3:synthetic_acceptance_length=2.8"
    built = build_engine(dep, text, "sim", BuildOptions(shares_prefixes=False))
    assert built.parts.policy.async_scheduling()
    assert any("spec v2" in n and "overlap scheduler on" in n for n in built.parts.notes)
    for flags, overlap in (("", True), (":disable_overlap_schedule=true", False)):
        spec = parse_policy_list(text + flags)[0]
        line = command_line(spec, dep, None, device, 4096)
        assert line is not None and ("--disable-overlap-schedule" in line) is (not overlap)
        back = translate(lint(f"SGLANG_SIMULATE_ACC_LEN=2.8 {line}"), device).spec
        config = SglangPolicy.default_config(device, 4096, **back.flags)
        assert SglangPolicy(config).async_scheduling() is overlap


def test_lockstep_dp_ranks_run_it_synchronously_and_keep_sglangs_other_notes():
    """An MoE model's data-parallel ranks step in lockstep, synchronously: spec v2 runs
    non-overlapped there, with the note why, SGLang's own warning and its running cap."""
    from tailserve.assemble import BuildOptions, build_engine
    from tailserve.executors.simulated.deployment import Deployment

    dep = Deployment.of("DeepSeek-V3", "h200", 4, "none", quantization="fp8", dp=2)
    text = "sglang:speculative_algorithm=NEXTN:synthetic_acceptance_length=2.8"
    built = build_engine(dep, text, "sim", BuildOptions(shares_prefixes=False))
    assert not built.parts.policy.async_scheduling()
    notes = built.parts.notes
    assert notes[0].startswith(
        "sglang overlap scheduler off: tailserve steps an MoE model's data-parallel ranks"
    )
    assert any("non-overlap (synchronous) spec v2" in n for n in notes)
    assert any("max_running_requests is reset to 48" in n for n in notes)
