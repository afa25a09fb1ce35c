"""Drive one pre-allocation turn of SGLang's decode server through its own
``DecodePreallocQueue`` (``disaggregation/decode.py``): ``resume_retracted_reqs``, then
``pop_preallocated`` when nothing stays retracted (``process_decode_queue``), over a real
``TokenToKVPoolAllocator`` and ``DecodeReqToTokenPool``; run with the SGLang venv's python
(``scripts/setup-peers.sh sglang``).

Standalone (standard library + SGLang). What is SGLang's: both methods whole (their budgets,
``_allocatable_token_budgets``, ``_required_admission_tokens``, ``_prealloc_required_tokens``,
the slot checks, the order and where a pass stops) and ``_pre_alloc`` over the two pools. What is
stubbed, because it talks to a prefill server or a model: the KV receivers (every queued
request's handshake is done: ``waiting_for_input``), ``_send_kv_metadata``, the host copy a
resumed request's KV comes back from (``restore_kv_cache``), the prefill-rank lookups, and the
process-wide config a launched server publishes (``get_disagg``, ``get_memory``: a decode server
without its radix cache, host receive off, the default retraction backup).

Protocol (JSON lines): prints ``{"ready": ..., "version": ...}``, then answers each case (the
fields of ``validate/sglang_prealloc.py``'s ``PreallocCase``) with ``{"resumed": [ids],
"preallocated": [ids]}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import types
from array import array

from _jsonl import package_version, serve  # the sibling module: this script's folder is on sys.path
from sglang_policy import _stub_torchvision


class Driver:
    def __init__(self) -> None:
        _stub_torchvision()
        import sglang.srt.disaggregation.decode as decode
        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.sampling.sampling_params import SamplingParams

        disagg = types.SimpleNamespace(
            disaggregation_decode_host_receive_threshold=1.0,
            disaggregation_decode_enable_radix_cache=False,
            disaggregation_decode_retraction_backup=None,
        )
        decode.get_disagg = lambda: disagg
        decode.get_memory = lambda: types.SimpleNamespace(disable_radix_cache=True)
        decode.restore_kv_cache = lambda *args, **kwargs: None  # the host copy back
        self.decode, self.torch, self.Req = decode, torch, Req
        self.Allocator, self.SamplingParams = TokenToKVPoolAllocator, SamplingParams

    def _req(self, row: list):
        request_id, prompt_len, outputs, max_new = row
        params = self.SamplingParams(max_new_tokens=max_new, ignore_eos=False)
        req = self.Req(request_id, "", array("q", [0] * prompt_len), params)
        req.output_ids = array("q", [0] * outputs)
        return req

    def run(self, case: dict) -> dict:
        decode, torch = self.decode, self.torch
        context = max([r[1] + max(r[2], 1) for k in ("running", "transferring", "arrived", "retracted", "queue")
                       for r in case[k]] + [1])  # fmt: skip
        alloc = self.Allocator(case["capacity"], torch.float16, "cpu", None, False)
        pool = decode.DecodeReqToTokenPool(
            size=case["max_running_requests"],
            max_context_len=context + 1,
            device="cpu",
            enable_memory_saver=False,
            pre_alloc_size=case["extra_slots"],
        )

        def hold(row: list, tokens: int):
            req = self._req(row)
            pool.alloc([req])
            alloc.alloc(tokens)
            return req

        running = [hold(r, r[1] + r[2]) for r in case["running"]]
        transfer = [types.SimpleNamespace(req=hold(r, r[1]), host_staged=False, prefix_match=None)
                    for r in case["transferring"]]  # fmt: skip
        arrived = [hold(r, r[1]) for r in case["arrived"]]
        scheduler = types.SimpleNamespace(
            running_batch=types.SimpleNamespace(reqs=running),
            waiting_queue=arrived,
            last_batch=None,
            enable_priority_scheduling=False,
            enable_hisparse=False,
            enable_lora=False,
            enable_overlap=False,
            enable_decode_hicache=False,
        )
        q = decode.DecodePreallocQueue.__new__(decode.DecodePreallocQueue)
        q.scheduler = scheduler
        q.token_to_kv_pool_allocator = alloc
        q.token_to_kv_pool = None
        q.draft_token_to_kv_pool = None
        q.req_to_token_pool = pool
        q.tree_cache = types.SimpleNamespace(maybe_hand_to_session=lambda req: None)
        q.num_reserved_decode_tokens = case["num_reserved_decode_tokens"]
        q.transfer_queue = types.SimpleNamespace(queue=transfer)
        q.retracted_queue = []
        for row in case["retracted"]:
            req = self._req(row)
            req.is_retracted = True
            q.retracted_queue.append(req)
        q.pending_reqs = []
        q.pp_size = 1
        q.req_to_metadata_buffer_idx_allocator = types.SimpleNamespace(available_size=lambda: 1 << 30)
        q.kv_manager = types.SimpleNamespace(kv_args=types.SimpleNamespace(state_types=[]))
        q._resolve_pending_reqs = lambda: None
        q._update_handshake_waiters = lambda *args: None
        q._send_kv_metadata = lambda *args, **kwargs: None
        not_ready = set(case.get("not_ready") or ())  # prefill_complete: prefill still running
        q.queue = [
            decode.DecodeRequest(req=self._req(row), kv_receiver=None, waiting_for_input=row[0] not in not_ready)
            for row in case["queue"]
        ]
        back = q.resume_retracted_reqs()
        scheduler.waiting_queue.extend(back)  # ``process_decode_queue``
        resumed = [req.rid for req in back]
        preallocated = []
        if not q.retracted_queue:  # ``process_decode_queue``: no new allocation while any waits
            done, _ = q.pop_preallocated()
            preallocated = [d.req.rid for d in done]
        return {"resumed": resumed, "preallocated": preallocated}


def main() -> None:
    serve("sglang-prealloc", package_version("sglang"), lambda: Driver().run)


if __name__ == "__main__":
    main()
