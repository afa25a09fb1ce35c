"""The decode step benchmarks' shared setup: the tiny model's batch of 64 requests of 256-token
prompts, prefilled until each has decoded once (``fill``); for the old-vs-new ones
(``decode_step_ab``, ``decode_step_host_ab``) the linear layers and decode attention timed by
wrapping their calls (``time_linear_and_attention``), the two sides' steps alternated old, new,
new, old, ... so that a busy moment or a growing context costs both alike (``alternate``), and
each side's medians with the rest of the step (``medians``)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tailserve.executors.pytorch import cpu_backend, cpu_kernels
from tailserve.llm import SamplingParams

BATCH, PROMPT = 64, 256


def prompts(count: int) -> list[list[int]]:
    """``count`` prompts of ``PROMPT`` seeded token ids (the same first ones whatever the count)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 8000, (PROMPT,), generator=g).tolist() for _ in range(count)]


def fill(engine: Any, steps: int) -> None:
    """Add the batch (seeded token ids, greedy, ``steps`` + 20 new tokens each) and step until
    every request has decoded once: the next ``steps`` steps are decode steps at batch 64."""
    params = SamplingParams(max_tokens=steps + 20, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts(BATCH)):
        engine.add_request(str(i), ids, params)
    while True:
        outs = engine.step()
        if len(outs) == BATCH and all(len(o.token_ids) >= 2 for o in outs):
            return


def time_linear_and_attention() -> dict[str, float]:
    """Wrap ``PackedLinear.__call__`` and the decode attention kernel so that each call adds its
    time to the returned dict's ``linear`` / ``attention``."""
    spent = {"linear": 0.0, "attention": 0.0}
    linear_call = cpu_backend.PackedLinear.__call__
    attention_call = cpu_kernels.paged_decode_attention

    def timed_linear(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        t = time.perf_counter()
        y = linear_call(self, x, bias)
        spent["linear"] += time.perf_counter() - t
        return y

    def timed_attention(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        y = attention_call(*a, **k)
        spent["attention"] += time.perf_counter() - t
        return y

    cpu_backend.PackedLinear.__call__ = timed_linear
    cpu_backend.cpu_kernels.paged_decode_attention = timed_attention
    return spent


def kernel_switch(level: str, mods: dict[str, Any]) -> tuple[list[Any], Callable[[str], None]]:
    """The model's packed linear layers, and ``use(tag)`` putting ``mods[tag]``'s C++ kernels
    under every user of them: this level's loaded module, each packed layer that had a kernel
    and each CPU backend (the weights' packed layout is the same for both builds)."""
    # type(), not isinstance: some of gc's objects are deprecation proxies that warn on __class__.
    objects = gc.get_objects()
    packed = [o for o in objects if type(o) is cpu_backend.PackedLinear]
    with_kernel = [p for p in packed if p.kernel is not None]
    backends = [o for o in objects if issubclass(type(o), cpu_backend.CpuBackend)]

    def use(tag: str) -> None:
        cpu_kernels._modules[level] = mods[tag]
        for p in with_kernel:
            p.kernel = mods[tag]
        for b in backends:
            b.kernels = mods[tag]

    return packed, use


def alternate(
    engine: Any, steps: int, use: Callable[[str], None], spent: dict[str, float]
) -> dict[str, dict[str, list[float]]]:
    """``steps`` decode steps, ``use("old")`` / ``use("new")`` before each in the order old, new,
    new, old, ...; per side the step's, the linear layers' and the attention's seconds, the first
    two steps dropped."""
    times: dict[str, dict[str, list[float]]] = {
        t: {"step": [], "linear": [], "attention": []} for t in ("old", "new")
    }
    for s in range(steps):
        tag = ("old", "new")[(s + s // 2) % 2]
        use(tag)
        spent["linear"] = spent["attention"] = 0.0
        t = time.perf_counter()
        outs = engine.step()
        step = time.perf_counter() - t
        assert len(outs) == BATCH, len(outs)
        if s >= 2:
            times[tag]["step"].append(step)
            times[tag]["linear"].append(spent["linear"])
            times[tag]["attention"].append(spent["attention"])
    return times


def medians(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Each side's median step, linear, attention and rest (step - linear - attention), ms,
    printed one line a side."""
    out = {}
    for tag, d in times.items():
        rest = [a - b - c for a, b, c in zip(d["step"], d["linear"], d["attention"])]
        out[tag] = m = {k: statistics.median(v) * 1e3 for k, v in (*d.items(), ("rest", rest))}
        print(
            f"{tag}: {len(d['step'])} steps, step {m['step']:.2f} ms (min {min(d['step']) * 1e3:.2f}): "
            f"linear {m['linear']:.2f}, attention {m['attention']:.2f}, rest {m['rest']:.2f} "
            f"(min {min(rest) * 1e3:.2f})"
        )
    return out
