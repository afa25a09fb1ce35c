"""The ``slo`` policy's cheap decode path (issue 35) leaves the KV cache as the general one does:
a decode whose slot is in its last, partly filled block allocates nothing, and the block it
fills becomes matchable in that very pass, as ``Scheduler.allocate`` makes it."""

from __future__ import annotations

from tests.test_slo_policy import CLASSES, LinearCost

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.kv.hashed import HashedKVCacheManager
from tailserve.kv.prefix import block_hashes
from tailserve.policies.slo import SloPolicy
from tailserve.policies.slo_predictor import Predictor

DEVICE = get_hardware("H100-SXM").device_info
BLOCK = 4


def _sched() -> Scheduler:
    policy = SloPolicy(
        SloPolicy.default_config(DEVICE, 8192, slo_classes=CLASSES, enable_prefix_caching=True)
    )
    sched = Scheduler(policy, HashedKVCacheManager(64, BLOCK), 8192)
    policy.predictor = Predictor(LinearCost())  # type: ignore[arg-type]
    return sched


def _decoding(sched: Scheduler, rid: str, prompt: int, outputs: int) -> Request:
    """A running request with ``outputs`` tokens sampled, the last one's KV still to compute;
    its keys cover prompt and outputs (a workload that planned them), registered as far as the
    general path had."""
    r = Request(rid, prompt, 100, 0.0, priority=0)
    sched.add_request(r, 0.0)
    sched.waiting.remove(r)
    sched.policy.state.info.pop(rid)
    tokens = list(range(1000, 1000 + prompt + 12))
    sched.kv_cache.set_prefix_keys(rid, block_hashes(tokens, BLOCK), tokens)
    computed = prompt + outputs - 1
    assert sched.allocate(r, computed)
    r.num_computed_tokens, r.num_output_tokens = computed, outputs
    r.token_times.extend([0.0] * outputs)
    sched.admit(r, 0.0)
    return r


def test_a_decode_that_fills_its_block_registers_it_in_the_same_pass():
    cheap, general = _sched(), _sched()
    # 11 computed: the 12th token fills the third block. 13 computed: the 14th fills nothing.
    # 12 computed: a new block (the general path, taken by both).
    shapes = {"fills": (10, 2), "inside": (10, 4), "new-block": (10, 3)}
    for sched in (cheap, general):
        for rid, (prompt, outputs) in shapes.items():
            _decoding(sched, rid, prompt, outputs)
    out = cheap.schedule(0.01)
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == dict.fromkeys(shapes, 1)
    for r in general.running:  # what the general path does for each decode
        assert general.allocate(r, r.num_computed_tokens + 1)
    kv, ref = cheap.kv_cache, general.kv_cache
    assert kv.num_registered("fills") == 3  # blocks 0-2, the third filled by this decode
    for rid in shapes:
        assert kv.num_registered(rid) == ref.num_registered(rid), rid
        assert kv.block_tables[rid] == ref.block_tables[rid], rid
    assert kv.num_free_blocks == ref.num_free_blocks
    kv.check_integrity()
