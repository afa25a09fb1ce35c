"""Seeded random differential workloads over the knobs the vLLM scheduler has.

Each workload is small (a dozen requests, a few hundred tokens each) so that thousands run in
minutes, yet covers what matters: budgets from 16 to 8192 tokens, ``max_num_seqs``,
``long_prefill_token_threshold``, prefix caching on and off with shared prefixes of block-aligned
and ragged lengths (and whole repeated prompts), fcfs and priority, KV caches small enough to
force preemption, aborts mid-prefill and mid-decode, stop tokens, prompts longer than the budget,
and chunked prefill off (budget = max_model_len, as vLLM requires).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from tailserve.executors.simulated.spec_decode import SpecDecoding, accepted_drafts, resolve_acceptance_rates
from tailserve.validate.workload import STOP_TOKEN_ID, RequestSpec, SchedulerSpec, Workload

_FIRST_TOKEN = 3  # 0..2 are special; STOP_TOKEN_ID is one of them
_VOCAB = 32000
_BUDGETS = (16, 24, 32, 48, 64, 96, 128, 200, 256, 512, 1024, 2048, 8192)


class _TokenSource:
    """Fresh token ids as runs of consecutive ids: content that never repeats by accident (so
    only the shared prefixes share), and that ``workload.encode_tokens`` stores as a few runs."""

    def __init__(self, rng: random.Random) -> None:
        self._next = rng.randrange(_FIRST_TOKEN, _VOCAB // 2)

    def take(self, n: int) -> list[int]:
        if self._next + n >= _VOCAB:
            self._next = _FIRST_TOKEN
        out = list(range(self._next, self._next + n))
        self._next += n
        return out


def _request(
    rng: random.Random,
    source: _TokenSource,
    i: int,
    arrival: int,
    prompt: list[int],
    max_tokens: int,
    stop_chance: float,
    abort_chance: float,
    abort_within: int,
) -> RequestSpec:
    """Request ``i``'s outputs (a stop token at a random place with ``stop_chance``), its abort
    (within ``abort_within`` steps of arriving, with ``abort_chance``) and priority, drawn in
    that order."""
    outputs = source.take(max_tokens)
    if rng.random() < stop_chance:
        outputs[rng.randrange(max_tokens)] = STOP_TOKEN_ID
    abort_step = arrival + rng.randint(1, abort_within) if rng.random() < abort_chance else None
    return RequestSpec(
        request_id=f"r{i:02d}",
        arrival_step=arrival,
        prompt_token_ids=prompt,
        output_token_ids=outputs,
        priority=rng.randint(0, 3),
        abort_step=abort_step,
    )


def _vllm_032_knobs(seed: int, threshold: int, max_num_seqs: int) -> dict[str, Any]:
    """vLLM 0.32's scheduler knobs for a workload, each from a generator of its own: every other
    draw, and so every earlier workload, is unchanged."""
    return {
        "long_prefill_token_threshold_adaptive": _adaptive(seed, threshold),
        "prefill_schedule_interval": _interval(seed),
        "max_num_active_seqs": _active(seed, max_num_seqs),
    }


def _adaptive(seed: int, threshold: int) -> bool:
    """``long_prefill_token_threshold_adaptive``, on in half the workloads with a threshold."""
    return threshold > 0 and random.Random(seed * 7919 + 11).random() < 0.5


def _interval(seed: int) -> int:
    """vLLM 0.32's ``prefill_schedule_interval`` (DP prefill balancing): 2-4 in a third of the
    workloads, from a generator of its own (every other draw unchanged)."""
    rng = random.Random(seed * 7919 + 13)
    return rng.choice((2, 3, 4)) if rng.random() < 1 / 3 else 1


def _active(seed: int, max_num_seqs: int) -> int | None:
    """vLLM 0.32's ``max_num_active_seqs``, 1 to ``max_num_seqs`` in a fifth of the workloads, from
    a generator of its own (every other draw unchanged)."""
    rng = random.Random(seed * 7919 + 17)
    return rng.randint(1, max_num_seqs) if rng.random() < 0.2 else None


def random_vllm_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    source = _TokenSource(rng)
    block_size = rng.choice((16, 16, 16, 8, 4))
    budget = rng.choice(_BUDGETS)
    max_num_seqs = min(budget, rng.choice((1, 2, 3, 4, 6, 8, 16, 64)))
    threshold = 0 if rng.random() < 0.5 else rng.randint(1, max(1, min(budget, 300)))

    # Shared prefixes: some a whole number of blocks, some ragged.
    prefixes = []
    for _ in range(rng.randint(0, 3)):
        n = block_size * rng.randint(1, 8) if rng.random() < 0.5 else rng.randint(1, 8 * block_size)
        prefixes.append(source.take(n))

    num_requests = rng.randint(1, 12)
    arrival = 0
    requests: list[RequestSpec] = []
    for i in range(num_requests):
        if rng.random() < 0.6:
            arrival += rng.choice((0, 0, 1, 2, 3, 5, 10))
        prompt: list[int] = []
        if prefixes and rng.random() < 0.7:
            prompt = list(rng.choice(prefixes))
        suffix = rng.choice((0, 1, 2, block_size - 1, block_size, rng.randint(1, 64), rng.randint(1, 300)))
        if not prompt and suffix == 0:
            suffix = rng.randint(1, 40)
        prompt += source.take(suffix)
        max_tokens = rng.choice((1, 2, 3, rng.randint(1, 16), rng.randint(1, 60)))
        requests.append(_request(rng, source, i, arrival, prompt, max_tokens, 0.1, 0.15, 30))

    # KV: from just enough for the largest request to more than everyone needs.
    need = [-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in requests]
    low, high = max(need), sum(need) + 4
    num_blocks = rng.randint(low, max(low, high)) if rng.random() < 0.6 else high + rng.randint(0, 64)
    prefix_caching = rng.random() < 0.7
    policy = rng.choice(("fcfs", "priority"))
    chunked = rng.random() >= 0.12
    max_model_len = 4096
    if not chunked:
        # vLLM refuses a budget below max_model_len without chunked prefill.
        max_model_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
        budget = max(budget, max_model_len)
        threshold = min(threshold, max_model_len)
    spec = SchedulerSpec(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=prefix_caching,
        scheduling_policy=policy,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        **_vllm_032_knobs(seed, threshold, max_num_seqs),
    )
    return Workload(scheduler=spec, requests=requests, max_steps=3000, seed=seed)


def random_vllm_v0_workload(seed: int) -> Workload:
    """The V1 generator's requests with V0's knobs: chunked prefill off (V0's default; the budget
    then covers max_model_len, as V0 requires) or on, preemption by recompute or swap with a CPU
    pool of random size, prefix caching, fcfs or priority."""
    base = random_vllm_workload(seed)
    rng = random.Random(seed * 7919 + 1)
    s = base.scheduler
    chunked = rng.random() < 0.5
    max_model_len = max(len(r.prompt_token_ids) + r.max_tokens for r in base.requests)
    budget = s.max_num_batched_tokens if chunked else max(s.max_num_batched_tokens, max_model_len)
    mode = rng.choice(("auto", "auto", "recompute", "swap"))
    need = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // s.block_size) for r in base.requests)
    cpu_blocks = rng.choice((0, need, need * 2, rng.randint(0, need))) if mode == "swap" else 0
    spec = replace(
        s,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        long_prefill_token_threshold=min(s.long_prefill_token_threshold, max_model_len) if chunked else 0,
        long_prefill_token_threshold_adaptive=False,  # V0 has none of these flags
        prefill_schedule_interval=1,
        max_num_active_seqs=None,
        preemption_mode=mode,
        num_cpu_blocks=cpu_blocks,
    )
    return replace(base, scheduler=spec)


def _tight_kv(base: Workload, rng: random.Random, extra_tokens: int) -> int:
    """KV blocks for a workload whose requests each need ``extra_tokens`` more slots than their
    tokens: the base's, raised where the largest would not fit, and in a third of the workloads
    cut to just above the largest request (preemption, and outputs in flight when it strikes)."""
    s = base.scheduler
    need = max(
        -(-(len(r.prompt_token_ids) + r.max_tokens + extra_tokens) // s.block_size) for r in base.requests
    )
    if rng.random() < 1 / 3:
        return need + rng.randint(0, 3)
    return max(s.num_blocks, need)


def random_vllm_async_workload(seed: int) -> Workload:
    """The V1 generator's workload with vLLM's async scheduling on (and a tight KV cache in a
    third of them, ``_tight_kv``)."""
    base = random_vllm_workload(seed)
    rng = random.Random(seed * 15485863 + 3)
    scheduler = replace(base.scheduler, async_scheduling=True, num_blocks=_tight_kv(base, rng, 0))
    return replace(base, scheduler=scheduler)


def random_vllm_pp_workload(seed: int) -> Workload:
    """The V1 generator's workload under pipeline parallelism: 2, 3 or 4 stages, async scheduling
    (vLLM 0.32's default on the V2 model runner) in half, a tight KV cache in a third."""
    base = random_vllm_workload(seed)
    rng = random.Random(seed * 32452843 + 5)
    scheduler = replace(
        base.scheduler,
        pipeline_parallel_size=rng.choice((2, 3, 4)),
        async_scheduling=rng.random() < 0.5,
        num_blocks=_tight_kv(base, rng, 0),
    )
    return replace(base, scheduler=scheduler)


SPEC_TOKENS = (1, 2, 4)


def random_vllm_pp_spec_workload(seed: int) -> Workload:
    """``random_vllm_pp_workload``'s stages with speculative decoding drawn as
    ``random_vllm_spec_workload`` draws it, async scheduling always on (vLLM 0.32's default on
    the V2 model runner; the synchronous case is not simulated: policies/vllm.py), so the GPU
    n-gram drafter where the draw is n-gram."""
    w = _with_drafts(random_vllm_pp_workload(seed), random.Random(seed * 49979687 + 11))
    s = w.scheduler
    method = "ngram_gpu" if s.speculative_method == "ngram" else s.speculative_method
    return replace(w, scheduler=replace(s, async_scheduling=True, speculative_method=method))


def random_vllm_spec_workload(seed: int) -> Workload:
    """The V1 generator's workload with speculative decoding: k drafts (1, 2 or 4), an n-gram
    drafter (no lookahead slots) or EAGLE (k lookahead slots, a prefix hit drops its last
    block), async scheduling on or off (``ngram_gpu`` with it, as vLLM requires), and acceptance
    rates of random shape; each request's accepted counts are drawn by the simulated executor's
    own model (``spec_decode.accepted_drafts``) with the workload's seed. The KV cache is raised
    where a request's drafts and lookahead would not fit (and tight in a third of the workloads,
    ``_tight_kv``), and ``long_prefill_token_threshold``
    kept at 0 or at least 1 + k (vLLM asserts below that when it pads a new decode)."""
    return _with_drafts(random_vllm_workload(seed), random.Random(seed * 104729 + 7))


def random_vllm_nixl_spec_workload(seed: int) -> Workload:
    """The P/D side's workload (``random_vllm_nixl_workload``) with speculative decoding drawn as
    ``random_vllm_spec_workload`` draws it (an MTP/EAGLE drafter with its lookahead slots, or
    n-gram; async scheduling on or off): a 2026 DeepSeek-style decode instance reading its
    prompts from a prefill instance, then verifying drafts."""
    return _with_drafts(random_vllm_nixl_workload(seed), random.Random(seed * 7919 + 13))


def random_vllm_offload_spec_workload(seed: int) -> Workload:
    """The CPU-tier workload (``random_vllm_offload_workload``) with speculative decoding drawn as
    ``random_vllm_spec_workload`` draws it: loads from the tier, then drafts."""
    return _with_drafts(random_vllm_offload_workload(seed), random.Random(seed * 6700417 + 29))


def _with_drafts(base: Workload, rng: random.Random) -> Workload:
    """``base`` with speculative decoding (``random_vllm_spec_workload``'s draws)."""
    seed = base.seed
    assert seed is not None  # (the acceptance draws are seeded by the workload's seed)
    k = rng.choice(SPEC_TOKENS)
    async_scheduling = rng.random() < 0.5
    method = rng.choice(("ngram_gpu" if async_scheduling else "ngram", "eagle"))
    if rng.random() < 0.5:
        rates = resolve_acceptance_rates(
            k, tuple(sorted((rng.random() for _ in range(k)), reverse=True)), None
        )
    else:
        rates = resolve_acceptance_rates(k, None, round(rng.uniform(1.0, k + 1.0), 3))
    spec = SpecDecoding(method, k, rates)
    requests = [
        replace(
            r,
            accepted=[
                accepted_drafts(spec, seed, r.request_id, len(r.prompt_token_ids) + i)
                for i in range(r.max_tokens + k + 1)
            ],
        )
        for r in base.requests
    ]
    s = base.scheduler
    lookahead = k if method == "eagle" else 0
    threshold = s.long_prefill_token_threshold
    if 0 < threshold < 1 + k:
        threshold = 1 + k if 1 + k <= s.max_model_len else 0
    scheduler = replace(
        s,
        num_blocks=_tight_kv(base, rng, k + lookahead),
        long_prefill_token_threshold=threshold,
        async_scheduling=async_scheduling,
        speculative_method=method,
        num_speculative_tokens=k,
        synthetic_acceptance_rates=list(rates),
    )
    return replace(base, scheduler=scheduler, requests=requests)


def random_vllm_offload_workload(seed: int) -> Workload:
    """vLLM's native KV offloading (``num_host_blocks``, a CPU tier): a few shared prefixes
    (block-aligned mostly, some ragged) that many requests come back to over time, a GPU pool small
    enough that the cached prefixes are evicted between their uses (from just above the largest
    request), and a tier that holds them all, some, or barely one block (its LRU evicts too);
    prefix caching on, fcfs or priority, aborts (some mid-load), stop tokens, chunked prefill with
    budgets from 16 tokens up, ``max_num_seqs`` from 1; async scheduling (vLLM's default) in half."""
    rng = random.Random(seed * 2654435761 + 11)
    source = _TokenSource(rng)
    block_size = rng.choice((16, 16, 8, 4))
    budget = rng.choice(_BUDGETS[:10])
    max_num_seqs = min(budget, rng.choice((1, 2, 3, 4, 8, 16)))
    threshold = 0 if rng.random() < 0.7 else rng.randint(1, max(1, min(budget, 200)))
    prefixes = []
    for _ in range(rng.randint(1, 4)):
        blocks = rng.randint(1, 8)
        n = (
            block_size * blocks
            if rng.random() < 0.75
            else block_size * blocks + rng.randint(1, block_size - 1)
        )
        prefixes.append(source.take(n))
    num_requests = rng.randint(2, 16)
    arrival = 0
    requests: list[RequestSpec] = []
    for i in range(num_requests):
        arrival += rng.choice((0, 0, 1, 2, 4, 8, 15, 30))
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.85 else []
        suffix = rng.choice((0, 1, block_size - 1, block_size, rng.randint(1, 48), rng.randint(1, 160)))
        if not prompt and suffix == 0:
            suffix = rng.randint(1, 40)
        prompt += source.take(suffix)
        max_tokens = rng.choice((1, 2, rng.randint(1, 12), rng.randint(1, 40)))
        requests.append(_request(rng, source, i, arrival, prompt, max_tokens, 0.08, 0.12, 12))
    need = [-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in requests]
    prefix_blocks = sum(len(p) // block_size for p in prefixes)
    low = max(need)
    num_blocks = low + rng.choice((0, 1, 2, 4, rng.randint(0, max(1, sum(need) // 2))))
    host = rng.choice(
        (1, 2, max(1, prefix_blocks // 2), prefix_blocks, prefix_blocks + 4, 4 * prefix_blocks + 16)
    )
    spec = SchedulerSpec(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=True,
        scheduling_policy=rng.choice(("fcfs", "fcfs", "priority")),
        num_host_blocks=max(1, host),
        async_scheduling=rng.random() < 0.5,
        **_vllm_032_knobs(seed, threshold, max_num_seqs),
    )
    return Workload(scheduler=spec, requests=requests, max_steps=3000, seed=seed)


def random_vllm_nixl_workload(seed: int) -> Workload:
    """vLLM as one side of a P/D pair with its ``NixlConnector`` (``nixl_role``): the decode
    instance (every request's prompt KV read from a remote prefill once admitted; some prompts
    share prefixes, so later reads start after a local hit) or the prefill instance (every
    request a ``max_tokens`` 1 copy, mostly, whose KV stays until sent); reads and sends reported
    from the same step to 20 steps later, KV from just above the largest request (admissions
    blocked, decodes preempted, finished prompts holding blocks), aborts (some mid-read), stop
    tokens, fcfs or priority, prefix caching mostly on, chunked prefill with budgets from 16
    tokens up, ``max_num_seqs`` from 1; async scheduling (vLLM's default) in half."""
    rng = random.Random(seed * 2654435761 + 23)
    source = _TokenSource(rng)
    role = rng.choice(("kv_consumer", "kv_consumer", "kv_producer"))
    block_size = rng.choice((16, 16, 8, 4))
    budget = rng.choice(_BUDGETS[:10])
    max_num_seqs = min(budget, rng.choice((1, 2, 3, 4, 8, 16)))
    threshold = 0 if rng.random() < 0.7 else rng.randint(1, max(1, min(budget, 200)))
    prefixes = [source.take(block_size * rng.randint(1, 6) + rng.choice((0, 0, rng.randint(1, block_size - 1))))
                for _ in range(rng.randint(0, 3))]  # fmt: skip
    num_requests = rng.randint(2, 16)
    arrival = 0
    requests: list[RequestSpec] = []
    for i in range(num_requests):
        arrival += rng.choice((0, 0, 1, 2, 4, 8, 15))
        prompt = list(rng.choice(prefixes)) if prefixes and rng.random() < 0.6 else []
        suffix = rng.choice((0, 1, block_size - 1, block_size, rng.randint(1, 48), rng.randint(1, 160)))
        if not prompt and suffix == 0:
            suffix = rng.randint(1, 40)
        prompt += source.take(suffix)
        if role == "kv_producer":
            max_tokens = 1 if rng.random() < 0.85 else rng.randint(2, 4)
        else:
            max_tokens = rng.choice((1, 2, rng.randint(1, 12), rng.randint(1, 40)))
        r = _request(rng, source, i, arrival, prompt, max_tokens, 0.08, 0.15, 12)
        requests.append(replace(r, transfer_steps=rng.choice((0, 0, 1, 2, 3, 8, 20))))
    need = [-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in requests]
    num_blocks = max(need) + rng.choice((0, 1, 2, 4, rng.randint(0, max(1, sum(need) // 2)), sum(need)))
    spec = SchedulerSpec(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=rng.random() < 0.8,
        scheduling_policy=rng.choice(("fcfs", "fcfs", "priority")),
        nixl_role=role,
        async_scheduling=rng.random() < 0.5,
        **_vllm_032_knobs(seed, threshold, max_num_seqs),
    )
    return Workload(scheduler=spec, requests=requests, max_steps=3000, seed=seed)
