"""Drive one prefill pass of SGLang's scheduler through its own ``SchedulePolicy`` and
``PrefillAdder`` over a real ``RadixCache`` and ``TokenToKVPoolAllocator``; run with the SGLang
venv's python (``scripts/setup-peers.sh sglang``).

Standalone (standard library + SGLang). What is SGLang's: the waiting-queue order
(``calc_priority``), shortest-prefill-first's chunk cap, every admission decision
(``add_chunked_req``, ``add_one_req``: budgets, chunking, the radix match and its locks, the
``new_token_ratio`` reservations) and priority preemption (``preempt_to_schedule``: whether, and
which running requests). What this script supplies, because it lives in ``Scheduler`` (which
needs a model worker): the walk over the waiting queue of ``_get_new_batch_prefill_raw``
(``scheduler.py``: the quick exits, the budget and running-cap checks, ``batch_is_full``), written
here line for line without its LoRA, HiCache, Mamba, beam, pooling, prefill-delayer and
disaggregation branches; ``get_num_allocatable_reqs`` as ``max_running_requests - running``
(one pipeline stage, a request pool of ``max_running_requests`` rows); and the running batch's
``release_req`` / ``filter_batch`` (free the victim's slots, then ``evict_from_tree_cache`` as
``release_req`` does, ``reset_for_retract``).

Protocol (JSON lines): prints ``{"ready": ..., "version": ...}``, then answers each case (the
fields of ``validate/sglang_pass.py``'s ``PassCase``) with ``{"order": [ids], "can_run":
[[id, extend tokens, prefix tokens]], "new_chunked": id, "chunked": id, "preempted": [ids],
"batch_is_full": bool, "engine_fails": why SGLang's scheduler would stop right after this pass,
or null}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import os
import types
from array import array
from collections.abc import Callable

from _jsonl import package_version, serve  # the sibling module: this script's folder is on sys.path
from sglang_policy import _stub_torchvision


class RunningBatch:
    """The running ``ScheduleBatch`` as the adder and the walk use it: its requests, emptiness,
    and the release of a priority-preemption victim."""

    def __init__(self, reqs: list, slots: dict, alloc, tree, evict: Callable) -> None:
        self.reqs = reqs
        self._slots, self._alloc, self._tree, self._evict = slots, alloc, tree, evict

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    def release_req(self, idx: int, remaining: int, offload_kv: bool = True) -> bool:
        req = self.reqs[idx]
        self._alloc.free(self._slots.pop(req.rid))  # its KV (none of it in the tree)
        self._evict(self._tree, remaining * 20)  # SGLANG_RETRACT_DECODE_STEPS
        req.reset_for_retract()
        return True

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


class Driver:
    def __init__(self) -> None:
        # SGLang's waiting-prefix refresh (``_touch_waiting_prefixes``: every 32nd ordering pass
        # of a cache-agnostic policy touches the waiting requests' cached prefixes, head last,
        # which reorders LRU eviction) is not modelled by tailserve: off here unless the caller
        # sets it (docs/validation.md gives the count with it on).
        os.environ.setdefault("SGLANG_ENABLE_WAITING_PREFIX_REFRESH", "0")
        _stub_torchvision()
        import sglang.srt.managers.schedule_policy as schedule_policy
        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        # The process-wide config a launched server publishes, answered as SGLang's unit tests
        # patch it: not disaggregated, LRU eviction, no encoder replay; ``get_schedule`` per case.
        schedule_policy.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="null")
        schedule_policy.get_memory = lambda: types.SimpleNamespace(radix_eviction_policy="lru")
        features = types.SimpleNamespace(enable_encoder_swa_bounded_replay=False)
        schedule_policy.get_exec = lambda: types.SimpleNamespace(features=features)
        self.sp, self.torch, self.Req = schedule_policy, torch, Req
        self.Allocator, self.InsertParams = TokenToKVPoolAllocator, InsertParams
        self.RadixCache, self.RadixKey, self.SamplingParams = RadixCache, RadixKey, SamplingParams
        self.evict = evict_from_tree_cache

    def _req(self, spec: dict, tokens: list[int]):
        params = self.SamplingParams(max_new_tokens=spec["max_tokens"], ignore_eos=False)
        req = self.Req(
            spec["request_id"],
            "",
            array("q", tokens),
            params,
            priority=spec.get("priority", 0),
            routing_key=spec.get("routing_key"),
        )
        req.output_ids = array("q", spec.get("output_token_ids", []))
        req.time_stats.wait_queue_entry_time = spec.get("queue_time", 0.0)
        req.arrival_processed_tokens = spec.get("arrival_processed_tokens", 0)
        return req

    def run(self, case: dict) -> dict:
        sp, AddReqResult = self.sp, self.sp.AddReqResult
        cfg = types.SimpleNamespace(
            schedule_policy=case["schedule_policy"],
            schedule_low_priority_values_first=case["schedule_low_priority_values_first"],
        )
        sp.get_schedule = lambda: cfg
        page = 1
        alloc = self.Allocator(case["capacity"], self.torch.float16, "cpu", None, False)
        tree = self.RadixCache.create_simulated(disable=case["disable_radix_cache"], mock_allocator=alloc)
        if not case["disable_radix_cache"]:
            for tokens in case["cached"]:  # as ``cache_finished_req`` leaves them
                value = alloc.alloc(len(tokens))
                key = self.RadixKey(token_ids=array("q", tokens))
                done = tree.insert(self.InsertParams(key=key, value=value))
                alloc.free(value[: done.prefix_len])  # the part the tree held already
        slots: dict = {}
        running = []
        for spec in case["running"]:  # decoding: prompt + outputs in KV, outside the tree
            n = spec["prompt_len"] + len(spec["output_token_ids"])
            slots[spec["request_id"]] = alloc.alloc(n)
            running.append(self._req(spec, [0] * spec["prompt_len"]))
        batch = RunningBatch(running, slots, alloc, tree, self.evict)
        chunked = None
        if case["chunked"] is not None:
            spec = case["chunked"]
            alloc.alloc(spec["computed"])  # its prefilled part, outside the tree
            chunked = self._req(spec, [0] * spec["prompt_len"])
        waiting = [self._req(w, w["prompt_token_ids"]) for w in case["waiting"]]
        for w, req in zip(case["waiting"], waiting, strict=True):  # what its last look left
            req.prefix_len = w.get("stale_prefix_len", 0)
            req.full_untruncated_fill_ids = (req.origin_input_ids + req.output_ids)[
                : w.get("stale_fill_len", 0)
            ]
        policy = sp.SchedulePolicy(
            case["schedule_policy"],
            tree,
            enable_hierarchical_cache=False,
            enable_priority_scheduling=case["enable_priority_scheduling"],
            schedule_low_priority_values_first=case["schedule_low_priority_values_first"],
        )
        preemption = case["enable_priority_scheduling"] and not case["disable_priority_preemption"]
        max_running = case["max_running_requests"]
        chunk_size = case["chunked_prefill_size"] if case["chunked_prefill_size"] > 0 else None
        result = {
            "order": [r.rid for r in waiting],  # as it stands when the pass exits early
            "can_run": [],
            "new_chunked": None,
            "preempted": [],
            "batch_is_full": False,
        }
        result["chunked"] = chunked.rid if chunked is not None else None

        # ``_get_new_batch_prefill_raw``, the pass's quick exits.
        batch_is_full = False
        if (batch_is_full or not waiting) and chunked is None:
            return result
        if max_running - len(batch.reqs) <= 0 and chunked is None and not preemption:
            result["batch_is_full"] = True
            return result
        policy.calc_priority(waiting, batch, processed_tokens=case["processed_tokens"])
        result["order"] = [r.rid for r in waiting]
        adder = sp.PrefillAdder(
            page,
            tree,
            alloc,
            batch,
            case["new_token_ratio"],
            case["max_prefill_tokens"],
            chunk_size,
            len(batch.reqs) if case["enable_mixed_chunk"] and chunk_size is not None else 0,
            case["priority_scheduling_preemption_threshold"],
            max_running_requests=max_running,
            prefill_max_requests=case.get("prefill_max_requests"),
            waiting_queue_len=len(waiting),
        )
        if chunked is not None:
            chunked.init_next_round_input()
            chunked.prefix_len = case["chunked"]["computed"]  # its checkpoint (``extend_end``)
            adder.chunked_req_limit = policy.shortest_prefill_chunk_limit(
                chunked, waiting, adder.rem_chunk_tokens or 0, page
            )
            chunked = adder.add_chunked_req(chunked)
        for req in waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            if len(adder.can_run_list) >= max_running - len(batch.reqs):
                batch_is_full = True
            if batch_is_full and (not preemption or not adder.preempt_to_schedule(req)):
                break
            req.init_next_round_input(tree)
            res = adder.add_one_req(req, has_chunked_req=chunked is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    batch_is_full = len(adder.can_run_list) > 0 or not batch.is_empty()
                break
        result["can_run"] = [[r.rid, r.extend_end - r.prefix_len, r.prefix_len] for r in adder.can_run_list]
        result["new_chunked"] = adder.new_chunked_req.rid if adder.new_chunked_req is not None else None
        result["chunked"] = chunked.rid if chunked is not None else result["new_chunked"]
        result["preempted"] = sorted(r.rid for r in adder.preempt_list)  # SGLang keeps them as a set
        result["batch_is_full"] = batch_is_full
        # ``alloc_for_extend`` after the pass: evict, then allocate every extend, or raise "Out of
        # memory" (a continuing chunk granted in full past the pool, its ``must progress`` rule).
        need = sum(r.extend_end - r.prefix_len for r in adder.can_run_list)
        fails = None
        if adder.new_chunked_req is not None and chunked is not None:
            fails = "AssertionError: a second chunked request (scheduler.py: assert self.chunked_req is None)"
        elif need > alloc.available_size() + tree.evictable_size():
            fails = "Out of memory allocating the batch (alloc_token_slots)"
        result["engine_fails"] = fails
        return result


def _handler() -> Callable[[dict], dict]:
    return Driver().run  # built after serve() sent the engine's prints to stderr


def main() -> None:
    serve("sglang", package_version("sglang"), _handler)


if __name__ == "__main__":
    main()
