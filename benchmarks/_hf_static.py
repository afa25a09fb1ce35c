"""Hugging Face ``transformers`` static batching: the baseline continuous batching is measured against.

``HfStatic.generate`` runs one left-padded batch through ``model.generate`` to one length.
``drive_static`` serves an arrival-timed run the way a static batcher does: whenever it is idle it
takes every request that has arrived (up to ``batch_size``), pads them to the longest prompt,
generates to the largest ``max_tokens`` and only then returns any of them — so each request's
first token comes when the batch's first decode step does (a streamer's first ``put`` after the
prompt), and it finishes when the whole batch does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from benchmarks._arrivals import RequestTiming, TimedRequest

PAD_ID = 2  # any id works: padded positions are masked out


class FirstTokenStreamer(BaseStreamer):
    """``generate`` calls ``put`` once with the prompt, then once per new token of the batch."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.num_puts = 0
        self.first_token_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_s = self.clock()

    def end(self) -> None:
        pass


class HfStatic:
    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        # ignore_eos, as every engine here runs: stop only at max_new_tokens. (None in the call's
        # own GenerationConfig would be filled in from the model's.)
        self.model.generation_config.eos_token_id = None

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, streamer: BaseStreamer | None = None
    ) -> list[list[int]]:
        """Greedy new tokens of each prompt, one padded batch."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD_ID)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, streamer=streamer
            )
        return out[:, width:].tolist()


def drive_static(hf: HfStatic, requests: list[TimedRequest], batch_size: int) -> list[RequestTiming]:
    timings = {r.request_id: RequestTiming(r.request_id, r.arrival_s) for r in requests}
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    pending: deque[TimedRequest] = deque()
    i = 0
    while i < len(requests) or pending:
        now = clock()
        while i < len(requests) and requests[i].arrival_s <= now:
            pending.append(requests[i])
            i += 1
        if not pending:
            time.sleep(max(0.0, requests[i].arrival_s - clock()))
            continue
        batch = [pending.popleft() for _ in range(min(batch_size, len(pending)))]
        streamer = FirstTokenStreamer(clock)
        hf.generate([r.prompt_token_ids for r in batch], max(r.max_tokens for r in batch), streamer)
        end = clock()
        for r in batch:
            timing = timings[r.request_id]
            timing.first_token_s = streamer.first_token_s
            timing.finish_s = end
            timing.num_output_tokens = r.max_tokens  # what it asked for; the rest of the row is waste
    return [timings[r.request_id] for r in requests]
