"""Runs inside a peer venv (``.peers/vllm`` or ``.peers/sglang``): the engine's own streaming
decision, step by step, for the cases on stdin (``benchmarks/stream_interval_check.py`` sends
them and compares; not a scheduler driver of ``validate/peers.py``). One JSON object in: ``{"engine": "vllm" | "sglang", "cases": [{"interval":
N, "request": M or null, "steps": [tokens per step, ...]}]}``; one out: ``{"sent": [[step
indices at which a chunk leaves], ...]}``.

vLLM: ``RequestState.make_request_output`` of ``v1/engine/output_processor.py`` (DELTA output, the
engine's ``stream_interval`` already clamped by ``from_new_request``, whose one line is
``max(request, server)``); a chunk left when ``sent_tokens_offset`` moved. SGLang:
``_GenerationStreamAccumulator.accept`` of ``managers/scheduler_components/output_streamer.py``,
the request's ``sampling_params.stream_interval`` read by the engine's code itself; a chunk left
when ``send_token_offset`` moved. Objects the decision does not read are stubs; what the engine
does after deciding (building the output) may fail on them and is not looked at.
"""

from __future__ import annotations

import contextlib
import json
import sys
from types import SimpleNamespace


class _Detokenizer:
    def __init__(self) -> None:
        self.output_token_ids: list[int] = []

    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def vllm_case(interval: int, request: int | None, steps: list[int]) -> list[int]:
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import RequestState

    state = RequestState.__new__(RequestState)
    state.output_kind = RequestOutputKind.DELTA
    state.stream_interval = interval if request is None else max(request, interval)
    state.sent_tokens_offset = 0
    state.detokenizer = _Detokenizer()
    sent = []
    for i, k in enumerate(steps):
        state.detokenizer.output_token_ids += [7] * k
        finished = i == len(steps) - 1
        # held: the decision returned None; sent: it went on to build the output (which may fail
        # on the stub: past the decision). Above 1 the offset moves exactly when sent (DELTA).
        before = state.sent_tokens_offset
        try:
            held = (
                state.make_request_output([7] * k, None, FinishReason.LENGTH if finished else None, None)
                is None
            )
        except Exception:
            held = False
        if state.stream_interval > 1 and held == (state.sent_tokens_offset != before):
            raise AssertionError(f"step {i}: the offset and the decision disagree")
        if not held:
            sent.append(i)
    return sent


def sglang_case(interval: int, request: int | None, steps: list[int]) -> list[int]:
    # SGLang imports torchvision at module level; the differential's driver stands an inert one in
    # (this script runs from the drivers' folder, as they do)
    from sglang_policy import _stub_torchvision

    _stub_torchvision()
    from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator

    acc = _GenerationStreamAccumulator(
        return_logprob=False,
        return_hidden_states=False,
        return_routed_experts=False,
        return_indexer_topk=False,
        spec_algorithm=None,
        disaggregation_mode=None,
        default_stream_interval=interval,
        default_force_stream_interval=50,
        get_cached_tokens_details=lambda req: None,
        is_request_level_customized_info_key=lambda key: False,
        current_weight_version=None,
    )
    done = {"now": False}
    req = SimpleNamespace(
        rid="r",
        beam_group=None,
        stream=True,
        sampling_params=SimpleNamespace(stream_interval=request),
        output_ids=[],
        output_ids_through_stop=[],
        send_token_offset=0,
        send_output_token_logprobs_offset=0,
        finished_output=False,
        finished_len=None,
        finished_reason=SimpleNamespace(to_json=lambda: {"type": "length"}),
        finished=lambda: done["now"],
        check_match_stop_str_prefix=lambda: False,
    )
    sent = []
    for i, k in enumerate(steps):
        req.output_ids += [7] * k
        req.output_ids_through_stop = list(req.output_ids)
        done["now"] = i == len(steps) - 1
        before = req.send_token_offset
        with contextlib.suppress(Exception):  # past the decision, building the output on stubs
            acc.accept(req=req)
        if req.send_token_offset != before:
            sent.append(i)
    return sent


def main() -> None:
    payload = json.loads(sys.stdin.read())
    run = vllm_case if payload["engine"] == "vllm" else sglang_case
    out = [run(c["interval"], c.get("request"), c["steps"]) for c in payload["cases"]]
    sys.stdout.write(json.dumps({"sent": out}) + "\n")


if __name__ == "__main__":
    main()
