"""The async decode run grows its decodes' KV in one ``allocate_each`` (issue 35): without prefix
caching ``Scheduler.update_async_run`` hands each request the ids its own ``allocate`` would have
taken, in running order, so every later allocation gets the ids stepping gives it; with prefix
caching (the hashed manager) each request still allocates and registers in turn. SGLang's chains
of runs (``async_decode_run._chain``, r50) are the exception: the requests that stay running take
their slots once, at the chain's end, after the finished ones returned theirs — other ids than
stepping's, which nothing reads (the plain manager, no prefix caching); the slots are conserved
and each request holds exactly its computed tokens' (the last test)."""

from __future__ import annotations

import copy

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.driver import SimDriver
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.sglang import SglangPolicy

CHECKED_RUNS = 40  # each check copies the manager (SGLang's pool: ~500,000 one-token slots)


def _engine(spec: str, shares_prefixes: bool):
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    requests = [Request(f"r{i}", 200 + 37 * (i % 11), 30 + 23 * (i % 7), 0.02 * i) for i in range(60)]
    # Bare lengths get the plain manager (``shares_prefixes=False``); SGLang's radix one (its
    # default, sim_memory's) takes nothing on allocation, so it takes the same path.
    options = BuildOptions(shares_prefixes=shares_prefixes, engine=EngineOptions())
    return build_engine(built, spec, "sim", options, source=ListSource(requests)).engine


def _allocate_per_request(
    kv: KVCacheManager, decodes: list[Request], held: list[int], m: int, num_behind: int = 0
) -> None:
    """The rule before issue 35's change: one ``allocate`` per request that grew, in order (the
    first ``num_behind`` get one output fewer: nothing of theirs was in flight)."""
    for i, (request, slots) in enumerate(zip(decodes, held)):
        finishes = request.num_output_tokens + m - (i < num_behind) >= request.max_tokens
        computed = request.num_computed_tokens + m - (1 if finishes else 0)
        if computed > slots:
            assert kv.allocate(request.request_id, computed) is not None


@pytest.mark.parametrize(
    "spec, shares_prefixes",
    [("sglang", True), ("sglang", False), ("vllm:async_scheduling=true", False), ("trtllm", False)],
)
def test_async_run_takes_the_ids_allocate_per_request_would(
    monkeypatch: pytest.MonkeyPatch, spec: str, shares_prefixes: bool
) -> None:
    # SGLang's chains take no ``update_async_run`` and other ids (the module's docstring): off.
    monkeypatch.setattr(SglangPolicy, "async_runs_chain", False)
    engine = _engine(spec, shares_prefixes)
    kv = engine.scheduler.kv_cache
    assert not kv.prefix_caching and engine.scheduler.async_scheduling
    assert type(kv).allocate is KVCacheManager.allocate  # allocate_each's own path
    original = Scheduler.update_async_run
    allocations: list[str] = []
    checked: list[int] = []
    plain_allocate = KVCacheManager.allocate

    def counting_allocate(self, request_id: str, num_total_tokens: int):
        allocations.append(request_id)
        return plain_allocate(self, request_id, num_total_tokens)

    def checking(self: Scheduler, decodes, held_tokens, token_times, num_behind=0):
        if len(checked) >= CHECKED_RUNS:
            return original(self, decodes, held_tokens, token_times, num_behind)
        expected = copy.deepcopy(self.kv_cache)
        _allocate_per_request(expected, decodes, held_tokens, len(token_times), num_behind)
        del allocations[:]
        monkeypatch.setattr(KVCacheManager, "allocate", counting_allocate)
        try:
            done = original(self, decodes, held_tokens, token_times, num_behind)
        finally:
            monkeypatch.setattr(KVCacheManager, "allocate", plain_allocate)
        assert not allocations  # one allocate_each, no allocate per request
        assert self.kv_cache.free_ids() == expected.free_ids()
        assert {r: list(t) for r, t in self.kv_cache.block_tables.items()} == {
            r: list(t) for r, t in expected.block_tables.items()
        }
        checked.append(sum(len(t) for t in self.kv_cache.block_tables.values()))
        return done

    monkeypatch.setattr(Scheduler, "update_async_run", checking)
    SimDriver(engine).run()
    assert len(checked) >= 10  # the runs were taken, and grew blocks
    assert max(checked) > 0


def test_the_order_of_the_growth_decides_the_ids() -> None:
    """What the check above would catch: the same growth taken in another order hands the
    requests other ids (so a later allocation's ids would differ from stepping's)."""
    kv = KVCacheManager(64, 1)
    for rid in ("a", "b", "c"):
        kv.allocate(rid, 3)
    other = copy.deepcopy(kv)
    kv.allocate_each(["a", "b", "c"], [5, 4, 6])
    for rid, total in (("a", 5), ("b", 4), ("c", 6)):
        other.allocate(rid, total)
    assert kv.block_tables == other.block_tables and kv.free_ids() == other.free_ids()
    swapped = KVCacheManager(64, 1)
    for rid in ("a", "b", "c"):
        swapped.allocate(rid, 3)
    swapped.allocate_each(["c", "b", "a"], [6, 4, 5])
    assert swapped.block_tables != kv.block_tables


@pytest.mark.parametrize("spec", ["vllm:async_scheduling=true", "trtllm"])
def test_registration_thresholds_skip_only_calls_that_register_nothing(
    monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """With prefix caching ``update_async_run`` calls ``register_computed`` only where the
    manager's threshold (``registers_from``) says a block can fill (r48): calling it for every
    request after the run, as before, registers nothing more. The requests carry token ids and
    planned outputs, so output blocks fill and register inside the runs."""
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    requests = []
    for i in range(60):
        request = Request(f"r{i}", 200 + 37 * (i % 11), 30 + 23 * (i % 7), 0.02 * i)
        request.prompt_token_ids = [(i % 3) * 1000 + t for t in range(request.prompt_len)]
        request.planned_output_token_ids = [50_000 + i * 1000 + t for t in range(request.max_tokens)]
        requests.append(request)
    options = BuildOptions(shares_prefixes=True, engine=EngineOptions())
    engine = build_engine(built, spec, "sim", options, source=ListSource(requests)).engine
    original = Scheduler.update_async_run
    registered: list[int] = []

    def checking(self: Scheduler, decodes, held_tokens, token_times, num_behind=0):
        kv = self.kv_cache
        assert kv.prefix_caching
        before = sum(kv.num_registered(r.request_id) for r in decodes)
        done = original(self, decodes, held_tokens, token_times, num_behind)
        after = [kv.num_registered(r.request_id) for r in decodes]
        finished = {id(r) for r in done}
        for request in decodes:
            known = request.num_computed_tokens - (0 if id(request) in finished else 1)
            kv.register_computed(request.request_id, known)
        assert [kv.num_registered(r.request_id) for r in decodes] == after
        registered.append(sum(after) - before)
        return done

    monkeypatch.setattr(Scheduler, "update_async_run", checking)
    SimDriver(engine).run()
    assert len(registered) >= 10 and sum(registered) > 0  # runs taken, blocks registered in them


def test_a_chain_conserves_the_slots_it_takes_in_another_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """After every chain of SGLang's runs the manager is whole (``check_integrity``: each slot
    free or held once) and every running request holds exactly its computed tokens' slots, as
    stepping leaves them; the chains were taken, and went past their first run."""
    from tailserve.executors.simulated import async_decode_run

    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    # Arrivals 0.4 s apart, outputs of 100-400 tokens: several requests finish between two
    # arrivals, so chains start after each arrival's prefill batch and go on past finishes.
    requests = [Request(f"r{i}", 200 + 37 * (i % 11), 100 + 43 * (i % 7), 0.4 * i) for i in range(60)]
    options = BuildOptions(shares_prefixes=False, engine=EngineOptions())
    engine = build_engine(built, "sglang", "sim", options, source=ListSource(requests)).engine
    kv = engine.scheduler.kv_cache
    assert type(kv) is KVCacheManager
    original = async_decode_run._chain
    chains: list[int] = []

    def checking(*args):
        steps = original(*args)
        kv.check_integrity()
        for request in engine.scheduler.running:
            assert kv.num_held(request.request_id) == request.num_computed_tokens
        chains.append(steps)
        return steps

    monkeypatch.setattr(async_decode_run, "_chain", checking)
    SimDriver(engine).run()
    assert len(chains) >= 10 and kv.used_block_count() == 0
    assert max(chains) > 100  # steps: several runs each
