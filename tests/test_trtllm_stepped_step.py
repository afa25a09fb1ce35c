"""The ``trtllm`` policy's stepped-step shortcuts (r49, issue 35) against the walk they replace.

1. ``micro_batch`` takes GUARANTEED_NO_EVICT's generation requests whole (``Fitting``), by
   arithmetic, instead of walking them one by one: the same batch as the walk over the same
   requests, and the contexts asked for no further, for prefixes longer than ``max_num_tokens``
   allows or than ``max_batch_size``, with ``skips`` (the overlap scheduler), draft tokens and
   chunked contexts; and whole runs equal runs whose capacity pass hands over a plain iterator.
2. A generation request's new token is registered (``cache_computed``) only at or past the KV
   manager's threshold (``registers_from``): at every step of runs whose replies are keyed
   (multi-turn chat), asking for each skipped registration afterwards changes nothing — and an
   off-by-one threshold is caught.
"""

from __future__ import annotations

import random

import pytest

from tailserve.core.request import Request
from tailserve.policies import trtllm as trtllm_module
from tailserve.policies.trtllm import TrtllmPolicy
from tailserve.policies.trtllm_capacity import Fitting, guaranteed_no_evict
from tailserve.policies.trtllm_config import EQUAL_PROGRESS, FIRST_COME_FIRST_SERVED
from tailserve.policies.trtllm_microbatch import micro_batch
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import LogNormal
from test_trtllm_capacity_state import _run


# ---- 1. the generation prefix taken whole ----------------------------------------------------
class _Counted:
    """An iterator over ``items`` that counts how many were asked for (laziness is part of the
    contract: GUARANTEED_NO_EVICT's second pass computes only what the walk asks for)."""

    def __init__(self, items: list[Request]) -> None:
        self._items = iter(items)
        self.asked = 0

    def __iter__(self):
        return self

    def __next__(self) -> Request:
        item = next(self._items)
        self.asked += 1
        return item


def _requests(rng: random.Random, num_generations: int, num_contexts: int):
    generations = []
    for i in range(num_generations):
        request = Request(f"g{i}", rng.randint(1, 300), 50, 0.0)
        request.num_computed_tokens = request.prompt_len + rng.randint(0, 40)
        request.num_output_tokens = request.num_computed_tokens - request.prompt_len + 1
        generations.append(request)
    contexts = []
    for i in range(num_contexts):
        request = Request(f"c{i}", rng.randint(1, 300), 50, 0.0)
        request.num_computed_tokens = rng.choice([0, 0, request.prompt_len // 2])  # some chunked
        contexts.append(request)
    return generations, contexts


def test_the_generation_prefix_taken_whole_is_the_walk_over_it():
    rng = random.Random(49)
    past_tokens = past_batch = ended_among_generations = 0
    for _ in range(3000):
        generations, contexts = _requests(rng, rng.choice([0, 1, 3, 8, 20, 40]), rng.choice([0, 1, 4]))
        ids = {r.request_id for r in generations}

        def is_generation(request: Request, ids=ids) -> bool:
            return request.request_id in ids

        skipped = {r.request_id for r in generations if rng.random() < 0.2}
        skips = rng.choice([None, lambda request, skipped=skipped: request.request_id in skipped])
        max_batch_size = rng.choice([1, 2, 5, 16, 256])
        max_num_tokens = rng.choice([1, 3, 7, 16, 40, 600, 8192])
        generation_tokens = rng.choice([1, 1, 2, 4])  # 1 + drafts
        chunking = rng.choice([None, FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS])
        args = (is_generation, max_batch_size, max_num_tokens, chunking, 4, generation_tokens, skips)
        walk_items = _Counted(generations + contexts)
        want = micro_batch(walk_items, *args)
        tail = _Counted(contexts)
        got = micro_batch(Fitting(list(generations), tail), *args)
        assert got.generations == want.generations
        assert got.contexts == want.contexts
        assert got.too_long == want.too_long
        # The contexts asked for: as many as the walk reached past the generation requests.
        assert tail.asked == max(walk_items.asked - len(generations), 0)
        past_tokens += len(generations) > max_num_tokens // generation_tokens
        past_batch += len(generations) >= max_batch_size
        ended_among_generations += bool(contexts) and not tail.asked
    # Prefixes past each limit, and walks that ended among the generation requests.
    assert past_tokens > 300 and past_batch > 300 and ended_among_generations > 300


def test_a_fitting_iterates_as_the_capacity_pass_yields():
    """Iterated, ``guaranteed_no_evict``'s answer is the list the engine's pass builds
    (``tests/test_trtllm_capacity_state.py`` compares it with the eager pass)."""
    generations = [Request(f"g{i}", 10, 5, 0.0) for i in range(3)]
    fitting = Fitting(generations, iter([Request("c", 10, 5, 0.0)]))
    assert [r.request_id for r in fitting] == ["g0", "g1", "g2", "c"]


# Whole runs: the policy with the prefix taken whole against the same policy handed a plain
# iterator (the walk request by request, as before r49). Tiny prompts arriving together: many
# generation requests at once. A context is admitted only where its tokens fit beside the
# generation requests', so without drafts the token budget seldom cuts them; with three drafts a
# generation request costs 4 tokens and a 1-token prompt admitted beside them outgrows it, and
# ``max_batch_size`` ends the walk whenever that many generate. Third field: a limit ends some
# step's walk among the generation requests (asserted where the case is built for it).
TINY = WorkloadSpec(
    "random", num_requests=120, rate=400.0, seed=6,
    input_len=LogNormal(3.0, 0.5, 16), output_len=LogNormal(150.0, 0.6, 400),
)  # fmt: skip
MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "synthetic_acceptance_length": 2.5}
RUNS = [
    ("drafts, token budget", {**MTP3, "max_num_tokens": 64}, True),
    (
        "drafts, token budget, no overlap",
        {**MTP3, "max_num_tokens": 64, "disable_overlap_scheduler": True},
        True,
    ),
    ("max_batch_size 5", {"max_batch_size": 5}, True),
    ("max_batch_size 5, no overlap", {"max_batch_size": 5, "disable_overlap_scheduler": True}, True),
    ("chunked, token budget 32", {"enable_chunked_prefill": True, "max_num_tokens": 32}, False),
    (
        "chunked, token budget 32, no overlap",
        {"enable_chunked_prefill": True, "max_num_tokens": 32, "disable_overlap_scheduler": True},
        False,
    ),
    ("STATIC_BATCH", {"capacity_scheduler_policy": "STATIC_BATCH", "max_num_tokens": 40}, False),
]


def _walked(*args):
    """The capacity pass handed over as a plain iterator: ``micro_batch`` walks every request."""
    return iter(guaranteed_no_evict(*args))


@pytest.mark.parametrize(("label", "flags", "ends"), RUNS, ids=[c[0] for c in RUNS])
def test_a_run_equals_one_that_walks_every_generation_request(monkeypatch, label, flags, ends):
    ended = []  # steps where the walk ended among the generation requests (a limit reached)

    def recorded(fitting, is_generation, max_batch_size, *args):
        skips = args[-1]
        if isinstance(fitting, Fitting):
            candidates = [r for r in fitting.generations if skips is None or not skips(r)]
        batch = micro_batch(fitting, is_generation, max_batch_size, *args)
        if isinstance(fitting, Fitting):
            taken = len(batch.generations)
            ended.append(taken < len(candidates) or taken >= max_batch_size)
        return batch

    monkeypatch.setattr(trtllm_module, "micro_batch", recorded)
    whole = _run(flags, TINY)
    monkeypatch.setattr(trtllm_module, "micro_batch", micro_batch)
    monkeypatch.setattr(trtllm_module, "guaranteed_no_evict", _walked)
    walked = _run(flags, TINY)
    assert all(r.is_finished for r in whole.requests)
    assert [r.token_times for r in whole.requests] == [r.token_times for r in walked.requests]
    assert [r.first_scheduled_time for r in whole.requests] == [
        r.first_scheduled_time for r in walked.requests
    ]
    assert len(ended) > 50 and (any(ended) or not ends)


# ---- 2. registration only at the manager's threshold ----------------------------------------
CHAT = WorkloadSpec("multi-turn", num_sessions=25, rate=6.0, seed=7, think_time=0.3, system_prompt_len=700)


class _RegistrationCheck:
    """Wraps ``TrtllmPolicy.schedule`` (``install``): after each step, asks again for every
    generation request's new token to be registered; each must change nothing (it was
    registered, or had nothing to register: the policy may skip only those)."""

    def __init__(self, schedule=TrtllmPolicy.schedule) -> None:
        self.asked = 0
        self.registered = 0  # generation requests whose blocks the policy's step registered
        self.schedule = schedule

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(
            TrtllmPolicy, "schedule", lambda policy, sched, now: self.step(policy, sched, now)
        )

    def step(self, policy: TrtllmPolicy, sched, now):
        kv = sched.kv_cache
        generating = [r for r in policy._active if policy._is_generation(r)]
        held = [kv.num_registered(r.request_id) for r in generating]
        out = self.schedule(policy, sched, now)
        ran = {id(item.request): item for item in out.scheduled}
        for request, was in zip(generating, held):
            item = ran.get(id(request))
            if item is None:
                continue
            before = kv.num_registered(request.request_id)
            self.registered += before > was
            sched.cache_computed(request, item.num_context_tokens + 1)
            if kv.num_registered(request.request_id) != before:
                raise AssertionError(f"a skipped registration of {request.request_id} registered blocks")
            self.asked += 1
        return out


class _LateThreshold(dict):
    """``registers_from`` read one token late: the step at the threshold is skipped."""

    def get(self, key, default=None):
        value = dict.get(self, key, default)
        return value + 1 if value is not None and value is not default else value


@pytest.mark.parametrize(
    "flags",
    [{"disable_overlap_scheduler": True}, {"disable_overlap_scheduler": True, "enable_chunked_prefill": True,
                                            "max_num_tokens": 256}],
    ids=["whole contexts", "chunked contexts"],
)  # fmt: skip
def test_only_registrations_that_change_nothing_are_skipped(monkeypatch, flags):
    check = _RegistrationCheck()
    check.install(monkeypatch)
    run = _run(flags, CHAT)
    assert all(r.is_finished for r in run.requests)
    # The replies are keyed: generation requests registered blocks as they filled, and most
    # steps had none to register.
    assert check.registered > 20 and check.asked > 10 * check.registered


def test_a_late_threshold_is_caught(monkeypatch):
    schedule = TrtllmPolicy.schedule

    def late(policy, sched, now):
        kv = sched.kv_cache
        if not isinstance(kv.registers_from, _LateThreshold):
            kv.registers_from = _LateThreshold(kv.registers_from)
        return schedule(policy, sched, now)

    _RegistrationCheck(late).install(monkeypatch)
    with pytest.raises(AssertionError, match="skipped registration"):
        # check_integrity off: it reads registers_from too, and would fail first
        _run({"disable_overlap_scheduler": True}, CHAT, check_integrity=False)
