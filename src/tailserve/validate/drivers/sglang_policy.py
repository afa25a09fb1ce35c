"""Drive SGLang's own ``SchedulePolicy.calc_priority`` over a real ``RadixCache``; run with the
SGLang venv's python (``scripts/setup-peers.sh sglang``).

Standalone (standard library + SGLang). What runs: the waiting-queue ordering of one scheduling
pass — fcfs (with or without priorities), lof, lpm (with its in-batch prefix deduplication),
dfs-weight, hrrn (fed the scheduler's processed-tokens counter and each request's snapshot),
shortest-prefill-first (and its cap on a continuing chunk), routing-key (the running batch's
keys) — against a radix tree holding the workload's cached sequences, and each request's
matched prefix length. What does not: SGLang's ``Scheduler`` needs a model worker, so batches,
budgets and retraction are not driven here (docs/validation.md says what that leaves).

Protocol (JSON lines): prints ``{"ready": ..., "version": ...}``, then answers each case
``{"policy", "enable_priority_scheduling", "schedule_low_priority_values_first", "cached":
[[token ids]], "waiting": [{"request_id", "prompt_token_ids", "max_tokens", "priority",
"queue_time", "output_token_ids", "arrival_processed_tokens", "routing_key"}],
"processed_tokens", "running_keys": [key], "chunk_probe": [tokens left, budget, page size] or
null}`` with ``{"order": [ids], "prefix_len": {id: tokens}, "chunk_limit": tokens or null}`` or
``{"error": ...}``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Callable

from _jsonl import package_version, serve  # the sibling module: this script's folder is on sys.path


def _stub_torchvision() -> None:
    """SGLang imports ``torchvision.transforms`` at module level for multimodal configs; the PyPI
    torchvision is a CUDA build that cannot load beside CPU torch. Transformers is imported first
    (so it sees no torchvision), then an inert module stands in for SGLang's imports; nothing in
    the scheduling path uses it."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:
        pass
    import transformers.image_utils  # noqa: F401  (decides now that torchvision is absent)

    def stub(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []

        def missing(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {"__init__": lambda self, *a, **k: None})

        module.__getattr__ = missing
        sys.modules[name] = module
        return module

    tv = stub("torchvision")
    tv.transforms = stub("torchvision.transforms")
    tv.transforms.functional = stub("torchvision.transforms.functional")
    tv.io = stub("torchvision.io")


class Driver:
    def __init__(self) -> None:
        _stub_torchvision()
        import sglang.srt.managers.schedule_policy as schedule_policy
        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        # calc_priority asks the process-wide config (published by a launched server) whether
        # this is a disaggregated decode instance; standalone, nothing is published. Answer
        # "not disaggregated", as SGLang's own unit tests patch such lookups.
        schedule_policy.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="null")
        # Likewise the radix eviction policy (SGLang's default, "lru"), read when it refreshes
        # the LRU times of waiting prefixes (which never changes the order).
        schedule_policy.get_memory = lambda: types.SimpleNamespace(radix_eviction_policy="lru")
        self.torch, self.Req, self.SchedulePolicy = torch, Req, SchedulePolicy
        self.InsertParams, self.RadixCache, self.RadixKey = InsertParams, RadixCache, RadixKey
        self.SamplingParams = SamplingParams

    def run(self, case: dict) -> dict:
        from array import array

        tree = self.RadixCache.create_simulated()
        slot = 0
        for tokens in case["cached"]:
            value = self.torch.arange(slot, slot + len(tokens), dtype=self.torch.int64)
            slot += len(tokens)
            tree.insert(self.InsertParams(key=self.RadixKey(token_ids=array("q", tokens)), value=value))
        policy = self.SchedulePolicy(
            case["policy"],
            tree,
            enable_hierarchical_cache=False,
            enable_priority_scheduling=case["enable_priority_scheduling"],
            schedule_low_priority_values_first=case["schedule_low_priority_values_first"],
        )
        waiting = []
        for r in case["waiting"]:
            params = self.SamplingParams(max_new_tokens=r["max_tokens"], ignore_eos=True)
            req = self.Req(
                r["request_id"],
                "",
                array("q", r["prompt_token_ids"]),
                params,
                priority=r["priority"],
                routing_key=r.get("routing_key"),
            )
            req.output_ids = array("q", r.get("output_token_ids", []))  # generated before a retraction
            req.time_stats.wait_queue_entry_time = r["queue_time"]
            # ``_add_request_to_queue``'s snapshot of the scheduler's counter.
            req.arrival_processed_tokens = r.get("arrival_processed_tokens", 0)
            waiting.append(req)
        # The running batch: routing-key reads only its requests' keys.
        running = types.SimpleNamespace(
            reqs=[types.SimpleNamespace(routing_key=k) for k in case.get("running_keys", [])]
        )
        policy.calc_priority(waiting, running, processed_tokens=case.get("processed_tokens", 0))
        # Match lengths exist only where this pass matched (cache-aware policies, lpm and hrrn
        # not in their fcfs fallback); the others match later, in the PrefillAdder.
        matched = policy.waiting_queue_prefix_matched(waiting)
        chunk_limit = None
        if case.get("chunk_probe") is not None:
            # The scheduler's call for a continuing chunked request (None unless the policy is
            # shortest-prefill-first): only its length and prefix_len are read.
            remaining, budget, page = case["chunk_probe"]
            chunked = types.SimpleNamespace(full_untruncated_fill_ids=[0] * remaining, prefix_len=0)
            chunk_limit = policy.shortest_prefill_chunk_limit(chunked, waiting, budget, page)
        return {
            "order": [req.rid for req in waiting],
            "prefix_len": {req.rid: int(req.num_matched_prefix_tokens) for req in waiting} if matched else {},
            "chunk_limit": chunk_limit,
        }


def _handler() -> Callable[[dict], dict]:
    return Driver().run  # built after serve() sent the engine's prints to stderr


def main() -> None:
    serve("sglang", package_version("sglang"), _handler)


if __name__ == "__main__":
    main()
