"""``LLM``: offline batch generation, as vLLM's ``LLM(model=...).generate(prompts, params)``.

Every prompt is queued at once and the engine steps until all have finished, so the batch is
scheduled by the chosen policy exactly as a burst of arrivals would be.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tailserve.llm.llm_engine import LLMEngine
from tailserve.llm.outputs import RequestOutput
from tailserve.llm.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]

_BUILDER_ARGS = {
    "executor",
    "dtype",
    "device",
    "seed",
    "hardware",
    "sim_model",
    "tensor_parallel_size",
    "max_model_len",
    "kv_cache_memory_gib",
    "served_model_name",
    "check_integrity",
}


class LLM:
    def __init__(self, model: str | Path | None = None, policy: str = "vllm", **kwargs: Any) -> None:
        """``kwargs``: engine arguments (dtype, device, seed, max_model_len, kv_cache_memory_gib,
        executor, ...) and the policy's own flags by their engine names (max_num_batched_tokens,
        max_num_seqs, enable_prefix_caching, chunked_prefill_size, ...)."""
        builder = {k: v for k, v in kwargs.items() if k in _BUILDER_ARGS}
        flags = {k: v for k, v in kwargs.items() if k not in _BUILDER_ARGS}
        self.engine = LLMEngine.from_args(model, policy=policy, policy_flags=flags, **builder)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Final outputs in the order of ``prompts``."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priority)} priorities")
        engine = self.engine
        ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = str(next(self._counter))
            engine.add_request(request_id, _prompt(prompt), p, priority=priority[i] if priority else 0)
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if progress is not None:
                            progress[0].advance(progress[1])
        finally:
            if progress is not None:
                progress[0].stop()
        return [results[i] for i in ids]


def _prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt
    return list(prompt)


def _progress(total: int) -> Any:
    from rich.progress import Progress

    progress = Progress(transient=True)
    task = progress.add_task("generating", total=total)
    progress.start()
    return progress, task
