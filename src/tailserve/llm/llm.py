"""``LLM``: offline batch generation, as vLLM's ``LLM(model=...).generate(prompts, params)``.

Every prompt is queued at once and the engine steps until all have finished, so the batch is
scheduled by the chosen policy exactly as a burst of arrivals would be.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from tailserve.core.sampling_params import SamplingParams
from tailserve.llm.engine_args import EngineArgs
from tailserve.llm.llm_engine import LLMEngine
from tailserve.llm.outputs import RequestOutput

Prompt = str | list[int] | dict[str, Any]

# Engine arguments; every other keyword is a policy flag.
_BUILDER_ARGS = {f.name for f in fields(EngineArgs)} - {"policy", "policy_flags"}


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
        """Final outputs in the order of ``prompts``, shaped like vLLM's (``out.prompt``,
        ``out.outputs[0].text``, ``out.metrics``, ...)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        inputs = [_prompt(p) for p in prompts]  # type: ignore[union-attr]
        texts = [p if isinstance(p, str) else None for p in inputs]
        return self._run(inputs, texts, sampling_params, priority, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of them, rendered with the tokenizer's chat template and tokenized without adding
        special tokens again (the template writes BOS itself); ``out.prompt`` is the rendered text."""
        if not messages:
            raise ValueError("chat: no messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        texts: list[str | None] = []
        inputs: list[str | list[int]] = []
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise ValueError("chat: each conversation is a list of {'role': ..., 'content': ...} dicts")
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            texts.append(text)
            inputs.append(tokenizer.encode(text, add_special_tokens=False))
        return self._run(inputs, texts, sampling_params, None, use_tqdm)

    def _run(
        self,
        prompts: list[str | list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
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
            engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0)
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
        outputs = [results[i] for i in ids]
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs


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
