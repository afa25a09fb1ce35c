"""The simulator's speed shortcuts change nothing: a plain KV manager that does not count
references (until something reads them) behaves block for block like one that counts, and
every policy gives the same results whether the counts are kept (integrity checks on) or not."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tailserve.assemble.build import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.driver import SimDriver
from tailserve.kv.paged import KVCacheManager
from tailserve.kv.radix_manager import RadixKVCacheManager
from tailserve.policies.registry import parse_policy_list
from tailserve.policies.sglang import SglangPolicy
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import LogNormal


class ListRadix(RadixKVCacheManager):
    """The radix manager with its slots in lists (``typed_slots`` off): the counting, list-based
    reference the typed managers are checked against (since r50 the radix manager's one-token
    slots are typed too)."""

    typed_slots = False


@pytest.mark.parametrize("block_size", [4, 1])  # 1: the plain manager's typed-array tables
def test_uncounted_manager_matches_a_counting_one_block_for_block(block_size: int) -> None:
    lazy = KVCacheManager(64, block_size, num_cpu_blocks=32)
    counted = ListRadix(64, block_size, num_cpu_blocks=32)
    counted._live_refs()  # counts from the start (a radix manager keeps them once its tree exists)
    assert lazy._refs is None and counted._refs is not None
    assert lazy._compact == (block_size == 1)
    rng = random.Random(7)
    live: list[str] = []
    swapped: list[str] = []
    for i in range(600):
        op = rng.random()
        if op < 0.45 or not live:
            rid = live[rng.randrange(len(live))] if live and rng.random() < 0.5 else f"r{i}"
            tokens = block_size * lazy.num_held(rid) + rng.randint(1, 12)
            got, want = lazy.allocate(rid, tokens), counted.allocate(rid, tokens)
            assert (got is None and want is None) or list(got) == want
            if rid not in live and rid in lazy.block_tables:
                live.append(rid)
        elif op < 0.75:
            rid = live.pop(rng.randrange(len(live)))
            assert lazy.free(rid) == counted.free(rid)
        elif op < 0.9:
            rid = live.pop(rng.randrange(len(live)))
            assert lazy.swap_out(rid) == counted.swap_out(rid)
            (swapped if rid in lazy.cpu_block_tables else live).append(rid)
        elif swapped:
            rid = swapped.pop(0)
            moved = lazy.swap_in(rid)
            assert moved == counted.swap_in(rid)
            (live if moved is not None else swapped).append(rid)
        # (The plain manager keeps typed arrays, the reference lists: compared as lists.)
        assert lazy.free_ids() == counted._free
        assert {k: list(t) for k, t in lazy.block_tables.items()} == counted.block_tables
    assert lazy._refs is None  # nothing read the counts: none were kept
    assert lazy._ref_counts == counted._ref_counts  # counted from the tables on first read
    lazy.check_integrity()
    for rid in list(lazy.block_tables):  # and kept from then on
        lazy.free(rid)
        counted.free(rid)
    assert lazy._ref_counts == counted._ref_counts == [0] * 64
    lazy.check_integrity()


def test_scheduled_decode_builds_what_the_class_call_builds() -> None:
    """``scheduled_decode`` (the policies' running loops) sets every field the dataclass's own
    ``__init__`` sets, to the same values: equal objects (an unset slot would raise here)."""
    from dataclasses import fields

    from tailserve.core.scheduler_output import ScheduledRequest, scheduled_decode

    request = Request("r", 10, 5, 0.0)
    fast, slow = scheduled_decode(request, 12), ScheduledRequest(request, 1, 12)
    assert type(fast) is ScheduledRequest
    for f in fields(ScheduledRequest):
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert fast == slow


def test_new_output_and_step_result_build_what_the_class_calls_build() -> None:
    """``new_output`` (the policies' ``schedule``) and ``step_result`` (the simulated executor)
    set every field the dataclasses' own ``__init__`` sets, to equal values, with containers of
    their own: two calls share no list, set or dict (a consumer appends to them)."""
    from dataclasses import fields

    from tailserve.core.executor import StepResult, step_result
    from tailserve.core.scheduler_output import SchedulerOutput, new_output

    for fast, slow, other in [
        (new_output(), SchedulerOutput(), new_output()),
        (step_result(0.25), StepResult(0.25), step_result(0.25)),
    ]:
        assert type(fast) is type(slow)
        for f in fields(slow):
            value = getattr(fast, f.name)
            assert value == getattr(slow, f.name) and type(value) is type(getattr(slow, f.name)), f.name
            if isinstance(value, list | set | dict):
                assert value is not getattr(other, f.name), f.name
        assert fast == slow


@pytest.mark.parametrize(
    "spec",
    [
        "sarathi:chunk_size=256,gpu_memory_utilization=0.25",  # KV pressure: preemptions
        "vllm:async_scheduling=false,max_num_batched_tokens=2048,gpu_memory_utilization=0.25",
    ],
)
def test_reused_decode_items_hold_each_steps_facts(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """Sarathi's phase 1 and vLLM's plain pass hand a running request the same one-token decode
    item from step to step (``ScheduledRequest``'s docstring): at every stepped iteration, with
    preemptions, each such item equals the one the class call would build then, no item is in a
    batch twice, the items are reused, and every one is dropped once its request leaves."""
    from tailserve.core.scheduler_output import ScheduledRequest
    from tailserve.policies.sarathi import SarathiPolicy
    from tailserve.policies.vllm import VllmPolicy

    cls = SarathiPolicy if spec.startswith("sarathi") else VllmPolicy
    original = cls.schedule
    seen: set[int] = set()
    reused = []
    policies = []

    def checking(self, sched, now):
        out = original(self, sched, now)
        policies.append(self)
        assert len({id(item) for item in out.scheduled}) == len(out.scheduled)
        kept = self._decode_items
        for item in out.scheduled:
            r = item.request
            if kept.get(r) is item:
                assert item == ScheduledRequest(r, 1, r.num_computed_tokens)
                reused.append(id(item) in seen)
                seen.add(id(item))
        return out

    monkeypatch.setattr(cls, "schedule", checking)
    workload = WorkloadSpec(
        "random", num_requests=120, rate=20.0, seed=4, input_len=LogNormal(1500, 1.0, 8000),
        output_len=LogNormal(200, 0.8, 1500),
    )  # fmt: skip
    _, iterations = _sarathi_fingerprint(spec, workload, fast=False)
    assert iterations > 1000 and sum(reused) > 1000
    assert policies[-1]._decode_items == {}  # every request finished: none kept


def test_batch_shape_counts_the_tokens_token_counts_counts() -> None:
    """``batch_shape`` leaves the output's token counts (``counted_tokens``) for the engine's log:
    the same pair ``token_counts`` counts itself, over decodes, chunks of every size (one and
    none included), speculative verifications and padding (which neither counts)."""
    from tailserve.core.scheduler_output import PaddingSlot, ScheduledRequest, SchedulerOutput
    from tailserve.executors.simulated.executor import batch_shape

    rng = random.Random(0)
    for _ in range(300):
        out = SchedulerOutput()
        for i in range(rng.randint(0, 12)):
            request = Request(f"r{i}", rng.randint(1, 40), rng.randint(1, 9), 0.0)
            request.num_computed_tokens = rng.randint(0, request.prompt_len)
            q = rng.choice([0, 1, 1, 1, 2, rng.randint(3, 64)])
            spec = rng.choice([0, 0, 0, rng.randint(1, 4)]) if q >= 1 else 0
            out.scheduled.append(
                ScheduledRequest(request, q, request.num_computed_tokens, num_spec_tokens=spec)
            )
        if rng.random() < 0.2:
            out.padding.append(PaddingSlot(rng.choice([1, 8]), rng.randint(0, 30)))
        expected = out.token_counts()
        batch_shape(out)
        assert out.counted_tokens == expected
        assert out.token_counts() == expected


def test_a_manager_that_overrides_holds_says_so() -> None:
    """Sarathi's phase 1 reads ``block_tables`` itself where ``holds_by_table_length``: any
    manager class with its own ``holds`` must turn the flag off."""
    from tailserve.kv.hashed import HashedKVCacheManager

    for cls in (KVCacheManager, HashedKVCacheManager, RadixKVCacheManager):
        assert cls.holds_by_table_length == (cls.holds is KVCacheManager.holds), cls.__name__


def test_compact_pool_is_built_and_refilled_as_a_list_pool_is() -> None:
    """The one-token-slot pool's typed array is built from numpy's bytes and a freed table goes
    back reversed by numpy (kv/paged.py): the same ids, in the same order, as the list stack a
    counting manager builds with ``range`` and refills with ``[::-1]``."""
    n = 100_003
    lazy = KVCacheManager(n, 1)
    counted = ListRadix(n, 1)
    assert lazy._compact and not counted._compact
    assert lazy.free_ids() == counted._free == list(range(n - 1, -1, -1))
    rng = random.Random(5)
    for i in range(40):
        tokens = rng.randint(1, 3000)
        assert list(lazy.allocate(f"r{i}", tokens) or []) == counted.allocate(f"r{i}", tokens)
    for i in rng.sample(range(40), 25):
        assert lazy.free(f"r{i}") == counted.free(f"r{i}")
        assert lazy.free_ids()[-5000:] == counted._free[-5000:]
    assert lazy.free_ids() == counted._free
    # The typed array keeps its length (only the stack's height moves): CPython would
    # reallocate it (mremap, ~6 MB for SGLang's pool) whenever it shrank by 16 or more.
    assert len(lazy._free) == n
    lazy.check_integrity()


@pytest.mark.parametrize("block_size", [16, 1])
def test_allocate_each_takes_the_blocks_allocate_would(block_size: int) -> None:
    """``allocate_each`` (one slice of the free stack for a decode run's growth) leaves the
    plain manager block for block where ``allocate`` per request leaves a counting one."""
    lazy = KVCacheManager(20000, block_size)
    counted = ListRadix(20000, block_size)
    rng = random.Random(3)
    ids = [f"r{i}" for i in range(40)]
    for rid in ids:
        tokens = rng.randint(1, 200)
        assert list(lazy.allocate(rid, tokens) or []) == (counted.allocate(rid, tokens) or [])
    for _ in range(30):
        chosen = [rid for rid in ids if rng.random() < 0.7]
        # Up to three new blocks each, or none (a total the table already holds).
        totals = [
            (len(lazy.block_tables[rid]) + rng.randint(-1, 3)) * block_size - rng.randint(0, block_size - 1)
            for rid in chosen
        ]
        lazy.allocate_each(chosen, totals)
        counted.allocate_each(chosen, totals)  # a subclass: one ``allocate`` per request
        assert lazy.free_ids() == counted._free
        assert {k: list(t) for k, t in lazy.block_tables.items()} == counted.block_tables
    lazy.check_integrity()
    with pytest.raises(RuntimeError):
        lazy.allocate_each(ids[:1], [len(lazy.block_tables[ids[0]]) * block_size + 20001 * block_size])


def test_radix_manager_counts_shared_references() -> None:
    radix = RadixKVCacheManager(32, 1)
    radix.allocate("a", 5)
    radix.allocate("b", 3)
    radix.share("c", radix.block_tables["a"][:2])
    assert sorted(c for c in radix._ref_counts if c) == [1, 1, 1, 1, 1, 1, 2, 2]
    radix.check_integrity()
    radix.free("a")
    assert radix.num_free_blocks == 32 - 3 - 2
    radix.check_integrity()


def _fingerprint(policy: str, check: bool) -> str:
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    workload = WorkloadSpec(
        "random",
        num_requests=120,
        rate=40.0,
        seed=11,
        input_len=LogNormal(900, 1.0, 6000),
        output_len=LogNormal(250, 0.8, 1500),
        arrival=ArrivalSpec("gamma", burstiness=0.5),
    )
    # gpu_memory_utilization small enough that KV runs out: preemption and retraction paths.
    spec = parse_policy_list(f"{policy}{',' if ':' in policy else ':'}gpu_memory_utilization=0.25")[0]
    run = run_policy(built, spec, WorkloadBuilder(workload), options=EngineOptions(check_integrity=check))
    log = {name: getattr(run.log, name) for name in run.log.FIELDS}
    tokens = {r.request_id: (r.token_times, r.num_preemptions, r.status.name) for r in run.requests}
    return json.dumps([run.summary(), log, tokens], sort_keys=True)


@pytest.mark.parametrize(
    "policy",
    [
        "vllm:async_scheduling=false:max_num_batched_tokens=4096",
        "vllm:async_scheduling=true",
        "vllm:async_scheduling=false:speculative_method=eagle3:num_speculative_tokens=3:synthetic_acceptance_length=2.5",
        "sarathi:chunk_size=512",
        "sglang",
        "tgi",
        "vllm-v0",
        "orca",
        "trtllm",
        "trtllm:disable_overlap_scheduler=true",
    ],
)
def test_results_identical_with_and_without_reference_counts(policy: str) -> None:
    assert _fingerprint(policy, check=False) == _fingerprint(policy, check=True)


def _sarathi_fingerprint(spec: str, workload: WorkloadSpec, fast: bool) -> tuple[str, int]:
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    run = run_policy(
        built, parse_policy_list(spec)[0], WorkloadBuilder(workload), options=EngineOptions(fast_forward=fast)
    )
    log = {name: getattr(run.log, name) for name in run.log.FIELDS}
    tokens = {r.request_id: (r.token_times, r.num_preemptions, r.status.name) for r in run.requests}
    return json.dumps([run.summary(), log, tokens], sort_keys=True), len(run.log)


@pytest.mark.parametrize(
    "spec",
    [
        "sarathi:chunk_size=512",
        "sarathi:chunk_size=256,gpu_memory_utilization=0.25",  # KV pressure: preemptions
        "sarathi:chunk_size=2048,max_num_seqs=8",
        # The dynamic chunk schedule changes the size as a prompt progresses: no run, still identical.
        "sarathi:enable_dynamic_chunking_schedule=true,low_chunk_size=256,high_chunk_size=1024,chunk_schedule_stages=4,chunk_schedule_max_tokens=8192",
    ],
)
def test_chunk_run_identical_to_plain_stepping(spec: str) -> None:
    workload = WorkloadSpec(
        "random",
        num_requests=150,
        rate=20.0,
        seed=4,
        input_len=LogNormal(1500, 1.0, 8000),
        output_len=LogNormal(200, 0.8, 1500),
    )
    fast, num_fast = _sarathi_fingerprint(spec, workload, fast=True)
    slow, num_slow = _sarathi_fingerprint(spec, workload, fast=False)
    assert num_fast == num_slow > 150
    assert fast == slow


@pytest.mark.parametrize(
    "spec",
    [
        "sarathi:chunk_size=512",
        "sarathi:chunk_size=256,gpu_memory_utilization=0.25",  # preempts
        "vllm:async_scheduling=false,max_num_batched_tokens=512",
        # Preemptions (no head then), and prompts capped to small chunks in the slow path.
        "vllm:async_scheduling=false,max_num_batched_tokens=2048,gpu_memory_utilization=0.25",
        "vllm:async_scheduling=false,max_num_batched_tokens=300,long_prefill_token_threshold=40",
    ],
)
def test_decode_head_is_what_batch_shape_and_update_would_derive(
    monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """Sarathi's phase 1 and vLLM's plain pass vouch for their leading decodes
    (``SchedulerOutput.decode_head``): at every stepped iteration, with preemptions too, the
    head's entries equal the class call's objects, each samples, and ``batch_shape`` prices the
    output as its own full pass does; the run equals one without the head."""
    from dataclasses import replace as replace_output

    from tailserve.core.scheduler_output import ScheduledRequest
    from tailserve.executors.simulated.executor import batch_shape
    from tailserve.policies.sarathi import SarathiPolicy
    from tailserve.policies.vllm import VllmPolicy

    policy = SarathiPolicy if spec.startswith("sarathi") else VllmPolicy
    original = policy.schedule
    heads: list[int] = []

    def checking(self, sched, now):
        out = original(self, sched, now)
        if out.decode_head is None:
            assert policy is VllmPolicy and out.preempted  # vLLM's pass vouches for none then
            return out
        m, context = out.decode_head
        head = out.scheduled[:m]
        for item in head:
            r = item.request
            assert item == ScheduledRequest(r, 1, r.num_computed_tokens)
            assert r.num_computed_tokens + 1 == r.prompt_len + r.num_output_tokens  # it samples
        assert context == sum(item.num_context_tokens for item in head)
        assert batch_shape(out) == batch_shape(replace_output(out, decode_head=None))
        heads.append(m)
        return out

    workload = WorkloadSpec(
        "random", num_requests=120, rate=20.0, seed=4, input_len=LogNormal(1500, 1.0, 8000),
        output_len=LogNormal(200, 0.8, 1500),
    )  # fmt: skip
    monkeypatch.setattr(policy, "schedule", checking)
    with_head, _ = _sarathi_fingerprint(spec, workload, fast=False)
    assert sum(heads) > 1000

    def headless(self, sched, now):
        out = original(self, sched, now)
        out.decode_head = None
        return out

    monkeypatch.setattr(policy, "schedule", headless)
    without, _ = _sarathi_fingerprint(spec, workload, fast=False)
    assert with_head == without


def test_chunk_run_takes_the_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run is used: far fewer engine steps than iterations on a chunked workload."""
    from tailserve.executors.simulated import chunk_run

    calls: list[int] = []
    original = chunk_run.advance_chunk_run

    def counting(engine):
        k = original(engine)
        calls.append(k)
        return k

    monkeypatch.setattr(chunk_run, "advance_chunk_run", counting)
    workload = WorkloadSpec(
        "random", num_requests=60, rate=10.0, seed=2, input_len=LogNormal(3000, 0.5, 8000)
    )
    _sarathi_fingerprint("sarathi:chunk_size=256", workload, fast=True)
    assert sum(calls) > 100


@pytest.mark.parametrize(
    "spec", ["sarathi:chunk_size=512", "sarathi:chunk_size=256,gpu_memory_utilization=0.25"]
)
def test_sarathi_chunk_runs_end_with_a_decodes_last_token(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """``chunk_run_ends_at_finish``: Sarathi's runs take the iteration in which decodes sample their
    last token (several at once too) and finish them at its end, with results identical to
    stepping (and to runs that stop before it, as TGI's do)."""
    from tailserve.executors.simulated import chunk_run
    from tailserve.policies.sarathi import SarathiPolicy

    finishes: list[int] = []
    original = chunk_run.advance_chunk_run

    def counting(engine):
        before = len(engine.scheduler.running)  # a run adds nobody to the batch
        k = original(engine)
        if k and len(engine.scheduler.running) < before:
            finishes.append(before - len(engine.scheduler.running))
        return k

    monkeypatch.setattr(chunk_run, "advance_chunk_run", counting)
    workload = WorkloadSpec(
        "random", num_requests=200, rate=20.0, seed=4, input_len=LogNormal(1500, 1.0, 8000),
        output_len=LogNormal(60, 0.8, 400),
    )  # fmt: skip
    fast, _ = _sarathi_fingerprint(spec, workload, fast=True)
    assert len(finishes) > 20 and max(finishes) > 1
    slow, _ = _sarathi_fingerprint(spec, workload, fast=False)
    monkeypatch.setattr(SarathiPolicy, "chunk_run_ends_at_finish", False)
    before_finish, _ = _sarathi_fingerprint(spec, workload, fast=True)
    assert fast == slow == before_finish


@pytest.mark.parametrize("spec", ["sarathi:chunk_size=512", "sarathi:chunk_size=300,max_num_seqs=4"])
def test_chunk_run_with_its_last_chunk_identical_to_plain_stepping(spec: str) -> None:
    """At a low rate nobody waits, so runs take the prompt's last chunk and its first token."""
    workload = WorkloadSpec(
        "random",
        num_requests=80,
        rate=2.0,
        seed=9,
        input_len=LogNormal(1200, 1.0, 6000),
        output_len=LogNormal(60, 1.0, 400),
    )
    fast, _ = _sarathi_fingerprint(spec, workload, fast=True)
    slow, _ = _sarathi_fingerprint(spec, workload, fast=False)
    assert fast == slow


LONG_PROMPTS = WorkloadSpec(
    "random",
    num_requests=120,
    rate=8.0,
    seed=6,
    input_len=LogNormal(2500, 0.9, 7500),
    output_len=LogNormal(120, 0.8, 600),
)


@pytest.mark.parametrize(
    "spec, workload",
    [
        ("sglang:disable_overlap_schedule=true,chunked_prefill_size=512", LONG_PROMPTS),
        ("sglang:disable_overlap_schedule=true,chunked_prefill_size=1024", replace(LONG_PROMPTS, seed=7)),
        # KV pressure at a high rate: a retraction.
        (
            "sglang:disable_overlap_schedule=true,chunked_prefill_size=512,gpu_memory_utilization=0.22",
            replace(LONG_PROMPTS, seed=3, rate=30.0),
        ),
        # The running cap.
        (
            "sglang:disable_overlap_schedule=true,chunked_prefill_size=300,max_running_requests=4",
            replace(LONG_PROMPTS, seed=9),
        ),
        # Mixed: no lone run.
        (
            "sglang:disable_overlap_schedule=true,chunked_prefill_size=512,enable_mixed_chunk=true",
            replace(LONG_PROMPTS, seed=10),
        ),
        # SGLang's overlap scheduler (its default): no lone chunk run (each chunk is scheduled
        # before the previous one's result), async decode runs between the prompts.
        ("sglang:chunked_prefill_size=512", LONG_PROMPTS),
    ],
)
def test_lone_chunk_run_identical_to_plain_stepping(spec: str, workload: WorkloadSpec) -> None:
    fast, num_fast = _sarathi_fingerprint(spec, workload, fast=True)
    slow, num_slow = _sarathi_fingerprint(spec, workload, fast=False)
    assert num_fast == num_slow > 120
    assert fast == slow


def test_lone_chunk_run_takes_the_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's chunked request runs its full chunks in one step: the path is used."""
    from tailserve.executors.simulated import prefill_run

    calls: list[int] = []
    original = prefill_run.advance_lone_chunk_run

    def counting(engine):
        k = original(engine)
        calls.append(k)
        return k

    monkeypatch.setattr(prefill_run, "advance_lone_chunk_run", counting)
    _sarathi_fingerprint(
        "sglang:disable_overlap_schedule=true,chunked_prefill_size=256", LONG_PROMPTS, fast=True
    )
    assert sum(calls) > 200


SHARED_PROMPTS = WorkloadSpec(
    "shared-prefix",
    num_requests=150,
    rate=8.0,
    seed=3,
    input_len=LogNormal(1500, 0.8, 6000),
    output_len=LogNormal(100, 0.8, 500),
)


@pytest.mark.parametrize(
    "spec, workload",
    [
        # The radix prefix cache on (the default) but unbuilt: these requests carry no token ids.
        ("tgi:max_batch_prefill_tokens=512", LONG_PROMPTS),
        ("tgi:max_batch_prefill_tokens=1024,disable_radix_cache=true", replace(LONG_PROMPTS, seed=7)),
        # KV pressure (TGI never preempts: the head blocks) at a high rate, rejections at the cap.
        (
            "tgi:max_batch_prefill_tokens=512,gpu_memory_utilization=0.25,max_concurrent_requests=40",
            replace(LONG_PROMPTS, seed=3, rate=30.0),
        ),
        ("tgi:max_batch_prefill_tokens=300", replace(LONG_PROMPTS, seed=9, rate=1.0)),  # nobody waits
        ("tgi:max_batch_prefill_tokens=256", replace(LONG_PROMPTS, rate=2.0)),  # arrivals inside runs
        # Shared system prompts: the radix trie is built, half the prompt tokens hit it.
        ("tgi:max_batch_prefill_tokens=512", SHARED_PROMPTS),
        ("tgi:max_batch_prefill_tokens=512,disable_radix_cache=true", replace(SHARED_PROMPTS, seed=4)),
        ("tgi:max_batch_prefill_tokens=256,block_size=16", replace(LONG_PROMPTS, seed=5, rate=12.0)),
        ("tgi:prefill_chunking=false", LONG_PROMPTS),  # legacy mode: no chunk run, still identical
        # Sessions release their next turn when one finishes or is rejected: arrivals inside runs.
        (
            "tgi:max_batch_prefill_tokens=256,max_concurrent_requests=12",
            WorkloadSpec(
                "multi-turn", num_sessions=30, rate=4.0, seed=2, think_time=0.5, system_prompt_len=900
            ),
        ),
    ],
)
def test_tgi_chunk_run_identical_to_plain_stepping(spec: str, workload: WorkloadSpec) -> None:
    fast, num_fast = _sarathi_fingerprint(spec, workload, fast=True)
    slow, num_slow = _sarathi_fingerprint(spec, workload, fast=False)
    assert num_fast == num_slow > workload.num_requests
    assert fast == slow


def test_tgi_chunk_run_takes_the_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    """TGI's chunking mode goes through executors/simulated/chunk_run.py: its prompts' chunks beside decodes
    are advanced in runs, including runs that start at a prompt's last chunk and runs that
    take arrivals."""
    from tailserve.core.engine import Engine
    from tailserve.executors.simulated import chunk_run

    calls: list[int] = []
    inside: list[bool] = [False]
    added_inside: list[int] = []
    original = chunk_run.advance_chunk_run
    original_add = Engine.add_arrivals

    def counting(engine):
        inside[0] = True
        k = original(engine)
        inside[0] = False
        calls.append(k)
        return k

    def adding(engine, now):
        if inside[0]:
            added_inside.append(1)
        original_add(engine, now)

    monkeypatch.setattr(chunk_run, "advance_chunk_run", counting)
    monkeypatch.setattr(Engine, "add_arrivals", adding)
    _sarathi_fingerprint(
        "tgi:max_batch_prefill_tokens=300", replace(LONG_PROMPTS, seed=9, rate=1.0), fast=True
    )
    assert sum(calls) > 400
    calls.clear()
    _sarathi_fingerprint("tgi:max_batch_prefill_tokens=256", replace(LONG_PROMPTS, rate=2.0), fast=True)
    assert sum(calls) > 400 and len(added_inside) > 10


@pytest.mark.parametrize("router", ["least-requests", "round-robin"])
def test_tgi_chunk_run_in_a_cluster_identical_to_plain_stepping(router: str) -> None:
    """A replica's run stops at the cluster's next event (its source's horizon) even while it
    could take arrivals, so the router sees the same replica states as with plain stepping."""
    from tailserve.cluster.build import build_stage, workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.spec import replicated
    from tailserve.policies.registry import PolicySpec

    deployment = Deployment("Llama-3-8B", "A100-80GB", 1, "none")
    workload = WorkloadBuilder(replace(LONG_PROMPTS, rate=6.0, num_requests=100))

    def tokens(fast: bool) -> dict:
        specs = replicated(2, deployment, PolicySpec.make("tgi", {"max_batch_prefill_tokens": "256"}))
        stage = build_stage(specs, router, shares_prefixes=False, options=EngineOptions(fast_forward=fast))
        run = run_aggregated(stage, workload_requests(workload, specs))
        return {r.request_id: (r.token_times, r.enqueue_time, r.status.name) for r in run.requests}

    assert tokens(True) == tokens(False)


# ---- vLLM's async scheduling: the async decode run (executors/simulated/async_decode_run.py) ----


def _async_fingerprint(
    spec: str, workload: WorkloadSpec, fast: bool, overhead: float | None = None, **options
) -> tuple[str, object]:
    """Every request's timestamps and counters, the iteration log field by field, the summary;
    ``overhead``: the cost model's per-step host time, to price forward passes shorter than it
    (the next step's forward pass then waits for its host part, not for the device)."""
    from tailserve.executors.simulated.cost_model import CostModel, Efficiency
    from tailserve.executors.simulated.deployment import BuiltCostModel
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model

    if overhead is None:
        built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    else:
        cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1, Efficiency(overhead=overhead))
        built = BuiltCostModel(cost, "none")
    opts = EngineOptions(fast_forward=fast, **options)
    run = run_policy(built, parse_policy_list(spec)[0], WorkloadBuilder(workload), options=opts)
    log = {name: getattr(run.log, name) for name in run.log.FIELDS}
    tokens = {
        r.request_id: (
            r.token_times,
            r.first_scheduled_time,
            r.finish_time,
            r.enqueue_time,
            r.num_preemptions,
            r.num_cached_tokens,
            r.status.name,
        )
        for r in run.requests
    }
    return json.dumps([run.summary(), log, tokens], sort_keys=True), run


def _assert_same(fast: str, slow: str, what: str = "") -> None:
    """``fast == slow``, failing with the first difference in context (pytest's own diff of two
    large JSON strings takes minutes)."""
    if fast == slow:
        return
    i = next((i for i, (a, b) in enumerate(zip(fast, slow)) if a != b), min(len(fast), len(slow)))
    pytest.fail(
        f"{what} fast and stepped differ at {i}: ...{fast[max(0, i - 150) : i + 60]!r} vs ...{slow[i : i + 60]!r}"
    )


BURSTY = WorkloadSpec(
    "random",
    num_requests=120,
    rate=25.0,
    seed=11,
    input_len=LogNormal(900, 1.0, 6000),
    output_len=LogNormal(250, 0.8, 1500),
    arrival=ArrivalSpec("gamma", burstiness=0.5),
)
# Few arrivals, long outputs: runs longer than SHORT_RUN (the numpy path).
SPARSE = WorkloadSpec(
    "random",
    num_requests=40,
    rate=1.5,
    seed=3,
    input_len=LogNormal(400, 0.8, 3000),
    output_len=LogNormal(500, 0.6, 1500),
)
ASYNC = "vllm:async_scheduling=true"
ASYNC_CASES = [
    (ASYNC, BURSTY, None),
    (f"{ASYNC},enable_prefix_caching=false", replace(BURSTY, seed=12), None),
    # KV pressure: preemptions with outputs in flight, waiting heads blocked by KV.
    (f"{ASYNC},gpu_memory_utilization=0.25", replace(BURSTY, seed=13, rate=40.0), None),
    (f"{ASYNC},gpu_memory_utilization=0.25,enable_prefix_caching=false", replace(BURSTY, seed=14), None),
    # Chunked prefills beside decodes, a per-request cap, the running cap.
    (f"{ASYNC},max_num_batched_tokens=512", replace(BURSTY, seed=15), None),
    (f"{ASYNC},long_prefill_token_threshold=256,max_num_seqs=6", replace(BURSTY, seed=16), None),
    (f"{ASYNC},enable_chunked_prefill=false,max_model_len=8192", replace(BURSTY, seed=17), None),
    # Priority scheduling: the waiting heap and the priority victim.
    (
        f"{ASYNC},scheduling_policy=priority,gpu_memory_utilization=0.25",
        replace(BURSTY, seed=18, rate=40.0, priorities=((0, 0.3), (1, 0.4), (5, 0.3))),
        None,
    ),
    (f"{ASYNC},scheduling_policy=priority", replace(SPARSE, priorities=((0, 0.5), (3, 0.5))), None),
    # Long runs, and forward passes shorter than the host part (larger overheads): the
    # recurrence's other branch, alone and mixed with the first as batches grow.
    (ASYNC, SPARSE, None),
    (ASYNC, replace(SPARSE, seed=4), 0.012),
    (ASYNC, replace(BURSTY, seed=19), 0.006),
    (f"{ASYNC},gpu_memory_utilization=0.25", replace(BURSTY, seed=20, rate=40.0), 0.009),
    # Prefix hits on shared system prompts; multi-turn sessions whose replies are keyed (blocks
    # cached only once their tokens are known) and whose next turn arrives when one finishes.
    (ASYNC, SHARED_PROMPTS, None),
    (f"{ASYNC},gpu_memory_utilization=0.3", replace(SHARED_PROMPTS, seed=5, rate=20.0), None),
    (
        ASYNC,
        WorkloadSpec("multi-turn", num_sessions=30, rate=4.0, seed=2, think_time=0.5, system_prompt_len=900),
        None,
    ),
    (
        f"{ASYNC},gpu_memory_utilization=0.25",
        WorkloadSpec("multi-turn", num_sessions=40, rate=8.0, seed=3, think_time=0.2),
        None,
    ),
    # Closed-loop clients: each finish releases the next request at once.
    (ASYNC, replace(SPARSE, num_requests=80, arrival=ArrivalSpec("closed", concurrency=12)), None),
    # Tenants in VTC order in front of the policy (FairPolicy forwards the run's hooks).
    (
        f"{ASYNC},fairness=vtc,gpu_memory_utilization=0.3",
        replace(BURSTY, seed=21, tenants=(("a", 0.7), ("b", 0.3))),
        None,
    ),
]


@pytest.mark.parametrize("spec, workload, overhead", ASYNC_CASES)
def test_async_decode_run_identical_to_plain_stepping(spec: str, workload: WorkloadSpec, overhead) -> None:
    fast, fast_run = _async_fingerprint(spec, workload, True, overhead)
    slow, slow_run = _async_fingerprint(spec, workload, False, overhead)
    assert len(fast_run.log) == len(slow_run.log) > len(slow_run.requests)
    _assert_same(fast, slow)


@pytest.mark.parametrize("seed", range(12))
def test_async_decode_run_identical_over_seeds(seed: int) -> None:
    """Random mixes of the cases' knobs, one per seed."""
    rng = random.Random(seed)
    flags = [ASYNC]
    if rng.random() < 0.5:
        flags.append(f"gpu_memory_utilization={rng.choice([0.25, 0.3, 0.5])}")
    if rng.random() < 0.3:
        flags.append("enable_prefix_caching=false")
    if rng.random() < 0.3:
        flags.append(f"max_num_batched_tokens={rng.choice([256, 1024, 2048])}")
    if rng.random() < 0.3:
        flags.append(f"max_num_seqs={rng.choice([4, 16, 64])}")
    priorities: tuple = ()
    if rng.random() < 0.3:
        flags.append("scheduling_policy=priority")
        priorities = ((0, 0.5), (2, 0.5))
    workload = WorkloadSpec(
        "random",
        num_requests=rng.randint(40, 120),
        rate=rng.choice([1.0, 5.0, 20.0, 60.0]),
        seed=100 + seed,
        input_len=LogNormal(rng.choice([200, 800, 2000]), 1.0, 6000),
        output_len=LogNormal(rng.choice([20, 150, 500]), 0.9, 1500),
        arrival=ArrivalSpec("gamma", burstiness=rng.choice([0.3, 1.0, 3.0])),
        priorities=priorities,
    )
    overhead = rng.choice([None, None, 0.004, 0.01])
    spec = ",".join(flags)
    fast, _ = _async_fingerprint(spec, workload, True, overhead)
    slow, _ = _async_fingerprint(spec, workload, False, overhead)
    _assert_same(fast, slow, spec)


def count_async_runs(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[bool]]:
    """Count the async decode runs (steps each advanced) and whether each skipping step priced
    was taken (a run's, or one of a chain's: ``_price_skip``); a synchronous decode run fails
    the test (async scheduling has none)."""
    from tailserve.executors.simulated import async_decode_run, decode_run

    calls: list[int] = []
    skips: list[bool] = []
    original = async_decode_run.advance_async_decode_run
    original_skip = async_decode_run._price_skip

    def counting(engine):
        k = original(engine)
        calls.append(k)
        return k

    def skipping(*args):
        step = original_skip(*args)
        skips.append(step is not None)
        return step

    monkeypatch.setattr(async_decode_run, "advance_async_decode_run", counting)
    monkeypatch.setattr(async_decode_run, "_price_skip", skipping)
    monkeypatch.setattr(decode_run, "advance_decode_run", lambda engine: pytest.fail("a synchronous run"))
    return calls, skips


def test_async_decode_run_takes_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The async run is used: most steps are advanced in runs, some longer than ``SHORT_RUN``
    (numpy), and runs end with the step that skips a request whose last token is in flight;
    with speculative decoding the policy declines (drafts step)."""
    from tailserve.executors.simulated import async_decode_run

    calls, skips = count_async_runs(monkeypatch)
    _, run = _async_fingerprint(ASYNC, SPARSE, True)
    assert sum(calls) > 0.8 * len(run.log)
    assert max(calls) > async_decode_run.SHORT_RUN and sum(skips) > 20
    calls.clear()
    spec = f"{ASYNC},speculative_method=eagle3,num_speculative_tokens=2,synthetic_acceptance_length=2"
    _async_fingerprint(spec, SPARSE, True)
    assert not calls


def test_async_decode_run_with_checks_and_batch_record_identical_to_plain_stepping() -> None:
    """With integrity checks after every run and the batch record: the same run, and the record
    (a run is one entry of several iterations) says the same per iteration."""

    def iterations(batches) -> list:
        rows = []
        for e in batches.entries:
            for j, (start, duration, used) in enumerate(zip(e.starts, e.durations, e.num_used_blocks)):
                contexts = [c + j for c in e.num_context_tokens]
                rows.append(
                    (start, duration, e.request_ids, e.num_new_tokens, contexts, used, e.waiting_head)
                )
        return rows

    spec = f"{ASYNC},gpu_memory_utilization=0.25"
    workload = replace(BURSTY, seed=22, rate=40.0)
    fast, fast_run = _async_fingerprint(spec, workload, True, check_integrity=True, record_batches=True)
    slow, slow_run = _async_fingerprint(spec, workload, False, check_integrity=True, record_batches=True)
    _assert_same(fast, slow)
    assert iterations(fast_run.batches) == iterations(slow_run.batches)
    assert len(fast_run.batches.entries) < len(slow_run.batches.entries)


def test_async_decode_run_in_a_cluster_identical_to_plain_stepping() -> None:
    """A replica's run stops at the cluster's next event (its source's next arrival)."""
    from tailserve.cluster.build import build_stage, workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.spec import replicated
    from tailserve.policies.registry import PolicySpec

    deployment = Deployment("Llama-3-8B", "A100-80GB", 1, "none")
    workload = WorkloadBuilder(replace(BURSTY, num_requests=100))

    def tokens(fast: bool) -> dict:
        specs = replicated(2, deployment, PolicySpec.make("vllm", {"async_scheduling": "true"}))
        stage = build_stage(
            specs, "least-requests", shares_prefixes=False, options=EngineOptions(fast_forward=fast)
        )
        run = run_aggregated(stage, workload_requests(workload, specs))
        return {r.request_id: (r.token_times, r.enqueue_time, r.status.name) for r in run.requests}

    assert tokens(True) == tokens(False)


@pytest.mark.parametrize(
    "spec",
    [
        "vllm:async_scheduling=false",
        "vllm:async_scheduling=false,max_num_seqs=6",  # a queue waits behind a full batch
        "sarathi:chunk_size=256,gpu_memory_utilization=0.25",  # KV pressure: preemptions
        "sglang:disable_overlap_schedule=true",
        "sglang:disable_overlap_schedule=true,max_running_requests=6",
        "orca",
    ],
)
def test_steady_after_run_agrees_with_steady(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between back-to-back decode runs the driver asks ``steady_after_run``, which skips the
    batch scans: at every such call it must answer what the full ``steady`` answers."""
    from tailserve.executors.simulated import driver

    answers: list[bool] = []
    original = driver.steady_after_run

    def checked(engine) -> bool:
        short = original(engine)
        assert short == driver.steady(engine)
        answers.append(short)
        return short

    monkeypatch.setattr(driver, "steady_after_run", checked)
    workload = WorkloadSpec(
        "random",
        num_requests=120,
        rate=8.0,
        seed=5,
        input_len=LogNormal(800, 0.8, 4000),
        output_len=LogNormal(150, 0.8, 1000),
    )
    fast, _ = _sarathi_fingerprint(spec, workload, fast=True)
    slow, _ = _sarathi_fingerprint(spec, workload, fast=False)
    assert fast == slow
    assert True in answers and False in answers  # both ways taken


def _sglang_abort_fingerprint(fast: bool) -> tuple[str, float | None]:
    """SGLang at its running cap: "c" waits behind "a" and "b" (``batch_is_full``), is aborted
    while waiting, which leaves the flag set on an empty queue; "a" finishes during decodes,
    and "d" arrives later, while "b" still decodes."""
    requests = [
        Request("a", 100, 40, 0.0),
        Request("b", 100, 300, 0.0),
        Request("c", 100, 50, 0.0),
        Request("d", 100, 20, 1.0),
    ]
    built = build_engine(
        Deployment("Llama-3-8B", "H100-SXM", 1, "none"),
        "sglang:disable_overlap_schedule=true,max_running_requests=2",
        "sim",
        BuildOptions(shares_prefixes=False, engine=EngineOptions(fast_forward=fast)),
        source=ListSource(requests),
    )
    engine = built.engine
    assert engine is not None
    sched, sim = engine.scheduler, SimDriver(engine)
    policy = sched.policy
    assert isinstance(policy, SglangPolicy)
    aborted_full = None
    while engine.step():
        if aborted_full is None and [r.request_id for r in sched.waiting] == ["c"] and policy.batch_is_full:
            sched.abort_request("c", "the client left", engine.clock.now)
            aborted_full = policy.batch_is_full and not sched.waiting
        sim.fast_forward()
    assert aborted_full  # the state the test is about was reached
    log = {name: getattr(engine.log, name) for name in engine.log.FIELDS}
    tokens = {r.request_id: (r.first_scheduled_time, r.token_times, r.status.name) for r in requests}
    return json.dumps([log, tokens], sort_keys=True), requests[3].first_scheduled_time


def test_sglang_decode_runs_clear_batch_is_full_after_a_finish_as_stepping_does() -> None:
    """Back-to-back decode runs with nobody waiting never call ``schedule``; the first iteration
    of each is one, and a request that left before it clears ``batch_is_full`` there (SGLang's
    ``update_running_batch`` filters it out). Without that replay the flag outlived "a"'s finish
    and "d" waited for "b" to finish (2.33 s instead of 1.0 s)."""
    fast, fast_start = _sglang_abort_fingerprint(True)
    slow, slow_start = _sglang_abort_fingerprint(False)
    assert slow_start is not None and slow_start < 1.01  # admitted on arrival
    assert fast_start == slow_start
    assert fast == slow


def test_slot_walk_stops_and_leaves_due_as_the_general_walk() -> None:
    """One-token slots with every request due in every iteration (SGLang's decode runs):
    ``_walk_slots`` gives the general walk's times, durations, needs and leftover ``due``
    across arrivals, KV shortages and exhausted steps, from any start."""
    from tailserve.executors.simulated.decode_run import _walk_blocks, _walk_slots

    rng = random.Random(11)
    for _ in range(500):
        steps = [rng.uniform(0.01, 0.05) for _ in range(rng.randint(1, 40))]
        now, start, count = rng.uniform(0, 10), rng.randint(0, 30), rng.randint(1, 30)
        wake = rng.choice([None, now + rng.uniform(0, 1.5)])
        free = rng.randint(0, 600)
        due_fast, due_slow = {start: count}, {start: count}
        fast = _walk_slots(iter(steps), now, wake, due_fast, start, free)
        slow = _walk_blocks(iter(steps), now, wake, due_slow, start, 1, free)
        assert fast == slow
        assert due_fast == due_slow


def test_due_after_with_slots_held_by_none_ahead_is_the_loops() -> None:
    """``finish_run._due_after``'s shortcut for one-token slots none holds ahead gives what its
    per-request loop gives (which ``_next_crossing`` defines)."""
    from tailserve.executors.simulated.finish_run import _due_after, _next_crossing

    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 30)
        ctx = [rng.randint(1, 5000) for _ in range(n)]
        held = list(ctx) if rng.random() < 0.7 else [c + rng.randint(0, 2) for c in ctx]
        order = rng.sample(range(n), n)
        p, steps = rng.randint(0, n), rng.randint(1, 40)
        expected: dict[int, int] = {}
        for i in order[p:]:
            j = _next_crossing(held[i] - ctx[i], steps, 1)
            expected[j] = expected.get(j, 0) + 1
        assert _due_after(None, ctx, held, order, p, steps, 1) == expected
