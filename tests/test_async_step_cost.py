"""The cheap paths of vLLM's async stepped iteration (issue 35) decide and price exactly what the
general ones do: the hashed manager's ``registers_from`` (below it ``register_computed`` changes
nothing), the advanced output's ``decode_head`` and its token counts, and the two plain decode
items per running request (never the one still in flight)."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from tailserve.assemble import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import advanced_batch_shape
from tailserve.kv.hashed import HashedKVCacheManager
from tailserve.kv.paged import NEVER
from tailserve.kv.prefix import block_hashes


def _registers_nothing_below(kv: HashedKVCacheManager, rid: str) -> None:
    """Every count below the threshold registers nothing (the callers skip those calls)."""
    before = kv.num_registered(rid)
    for n in range(min(kv.registers_from.get(rid, NEVER), 40)):
        kv.register_computed(rid, n)
        assert kv.num_registered(rid) == before
    kv.check_integrity()  # ``registers_from`` as derived from the registered blocks and keys


def test_registers_from_follows_every_change_of_the_registered_blocks():
    kv = HashedKVCacheManager(num_blocks=32, block_size=4, num_cpu_blocks=16)
    tokens = list(range(100, 120))
    keys = block_hashes(tokens, 4)  # 5 full blocks
    kv.set_prefix_keys("a", keys, tokens)
    assert kv.registers_from["a"] == 4
    assert "plain" not in kv.registers_from  # no keys: every call is a no-op
    kv.allocate("plain", 12)
    kv.register_computed("plain", 12)
    assert kv.num_registered("plain") == 0

    kv.allocate("a", 10)  # 3 blocks
    _registers_nothing_below(kv, "a")
    kv.register_computed("a", 9)
    assert (kv.num_registered("a"), kv.registers_from["a"]) == (2, 12)
    kv.register_computed("a", 16)  # the table (3 blocks) caps it
    assert (kv.num_registered("a"), kv.registers_from["a"]) == (3, 16)
    _registers_nothing_below(kv, "a")
    kv.allocate("a", 20)
    kv.register_computed("a", 20)  # every key registered: nothing left to register
    assert kv.num_registered("a") == 5 and "a" not in kv.registers_from
    _registers_nothing_below(kv, "a")

    kv.set_prefix_keys("b", keys, tokens)
    match = kv.match_prefix("b", 20)
    assert match is not None and len(match.kv_indices) == 4  # one token left to compute
    assert kv.allocate_with_prefix("b", match, 20)
    assert (kv.num_registered("b"), kv.registers_from["b"]) == (4, 20)
    _registers_nothing_below(kv, "b")
    assert kv.swap_out("b") is not None
    assert kv.registers_from["b"] == 4  # nothing of it registered now
    _registers_nothing_below(kv, "b")

    kv.free("a", 20, True)  # a preempted or finished request: its keys stay until forgotten
    assert kv.registers_from["a"] == 4
    kv.forget_prefix_keys("a")
    assert "a" not in kv.registers_from
    kv.check_integrity()


def _decoding(rid: str, prompt: int, outputs: int) -> Request:
    r = Request(rid, prompt, 100, 0.0)
    r.num_computed_tokens, r.num_output_tokens = prompt + outputs - 1, outputs
    return r


def test_an_advanced_decode_head_prices_and_counts_as_the_full_pass():
    """Two leading plain decodes vouched for by ``decode_head``, then a one-token verification,
    a cut verification, a prompt's chunk and a decode after them: the same shape and token
    counts as the pass over every entry."""
    d1, d2, d3 = _decoding("d1", 40, 6), _decoding("d2", 300, 2), _decoding("d3", 80, 9)
    v1, v2, prompt = _decoding("v1", 100, 4), _decoding("v2", 60, 3), Request("p", 900, 10, 0.0)
    items = [
        ScheduledRequest(d1, 1, 45),
        ScheduledRequest(d2, 1, 301),
        ScheduledRequest(v1, 1, 103, num_spec_tokens=1),
        ScheduledRequest(v2, 3, 62, num_spec_tokens=2),
        ScheduledRequest(prompt, 256, 0, partial=True),
        ScheduledRequest(d3, 1, 88),
    ]
    full = SchedulerOutput(scheduled=items, advanced=True)
    headed = replace(full, decode_head=(2, 45 + 301))
    shape, counts_then = advanced_batch_shape(full), full.counted_tokens
    assert advanced_batch_shape(headed) == shape
    assert counts_then == headed.counted_tokens == replace(full, counted_tokens=None).token_counts()
    assert counts_then == (256, 1 + 1 + 1 + 3 + 1)


@pytest.mark.parametrize("fast", [False, True])
def test_async_plain_decodes_reuse_two_items_and_never_the_one_in_flight(fast):
    """The advanced pass hands a running request the item it did not hand out last: no output
    shares an item with the one before it (still in flight while it is scheduled; with the
    driver's async decode runs, the step a run leaves in flight keeps those items), and items
    do come back two steps later."""
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    requests = [Request(f"r{i}", 30 + 17 * i, 40 + 3 * i, 0.05 * i) for i in range(10)]
    options = BuildOptions(engine=EngineOptions(fast_forward=fast))
    engine = build_engine(
        built, "vllm:async_scheduling=true", "sim", options, source=ListSource(requests)
    ).engine
    outputs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def kept(now: float) -> SchedulerOutput:
        out = schedule(now)
        outputs.append(out)  # kept alive, so ids are not reused
        return out

    engine.scheduler.schedule = kept  # type: ignore[method-assign]
    SimDriver(engine).run()
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    ids = [{id(item) for item in out.scheduled} for out in outputs if out.scheduled]
    assert len(ids) > (8 if fast else 100)
    assert not any(a & b for a, b in pairwise(ids))
    assert sum(len(a & c) for a, c in zip(ids, ids[2:])) > 0
    assert sum(out.decode_head is not None and out.decode_head[0] > 0 for out in outputs) > (
        2 if fast else 50
    )
