"""Policy config -> KV capacity -> KV manager -> scheduler, written once for every executor.

Each executor sizes the KV cache its own way (the simulator from the catalog's memory, the real
executor from the loaded model and the memory it is given); everything around that step is the
same, and lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.scheduler import Scheduler
from tailserve.kv.factory import make_kv_cache
from tailserve.kv.host_tier import host_tier_chunks
from tailserve.kv.secondary_pool import secondary_pool_blocks
from tailserve.policies.fairness import with_fairness
from tailserve.policies.registry import PolicySpec, get_policy_cls, make_policy

GIB = 2**30


class KVSize(Protocol):
    """How many KV blocks the device holds (``KVCapacity`` for the simulator)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...  # tokens per block

    @property
    def kv_bytes_per_token(self) -> int: ...  # per tensor-parallel shard


@dataclass(slots=True)
class SchedulerParts:
    spec: PolicySpec
    config: Any  # the policy's frozen config dataclass, defaults resolved for the device
    policy: Policy
    kv_size: KVSize
    num_cpu_blocks: int  # vLLM V0's --swap-space in blocks; 0 without a swap pool
    max_model_len: int  # tokens
    scheduler: Scheduler
    # Defaults chosen by an engine's rule, in a line each (vLLM's async scheduling on or off, and
    # why): the run's notes. ``spec`` then carries a default the executor had to change.
    notes: tuple[str, ...] = ()


def make_scheduler(
    policy: Policy,
    num_blocks: int,
    block_size: int,
    num_cpu_blocks: int,
    max_model_len: int,
    shares_prefixes: bool,
    num_host_blocks: int = 0,
) -> Scheduler:
    """The one place a KV manager is made: the kind the policy's config asks for. Prefix caching
    needs token identities, so a workload of bare lengths (``shares_prefixes=False``) gets a
    plain manager. ``num_host_blocks``: the CPU offloading tier's chunks, when the policy asks
    for one (vLLM ``--kv-offloading-size``)."""
    kv = make_kv_cache(
        policy.kv_spec(), num_blocks, block_size, num_cpu_blocks, shares_prefixes, num_host_blocks
    )
    return Scheduler(policy, kv, max_model_len)


# The flags that schedule a step while the previous one runs, the value that turns that off, and
# the note of a run whose executor steps only synchronously: vLLM's async scheduling and
# TensorRT-LLM's and SGLang's overlap schedulers (policies/trtllm_overlap.py, sglang_overlap.py).
_OVERLAP_FLAGS = {
    "async_scheduling": (False, "async scheduling off: {why} (vLLM 0.32 would schedule asynchronously here)"),
    "disable_overlap_scheduler": (
        True,
        "overlap scheduler off: {why} (TensorRT-LLM 1.2 would overlap scheduling with the forward here)",
    ),
    "disable_overlap_schedule": (
        True,
        "sglang overlap scheduler off: {why} (SGLang 0.5.23 would overlap here)",
    ),
}


def overlap_flag(config: Any) -> str:
    """The flag (as a user writes it) that turned on the overlapped loop of ``config``'s engine."""
    for name, (off, _) in _OVERLAP_FLAGS.items():
        if hasattr(config, name):
            return name if off is False else f"{name}=false"
    return "async_scheduling"


def build_scheduler(
    spec: PolicySpec,
    device: DeviceInfo,
    max_model_len: int,
    size_kv: Callable[[Any], KVSize],
    *,
    shares_prefixes: bool,
    cpu_swap: bool = True,
    synchronous: str = "",
    host_copies: int | None = None,
) -> SchedulerParts:
    """The policy's config for ``device`` (its engine's defaults, the user's flags on top), the
    KV blocks ``size_kv`` gives for that config (ValueError when one sequence cannot fit), the
    CPU swap pool its ``swap_space`` asks for, and the scheduler over them.

    ``synchronous``: why the executor runs steps only synchronously ("" when it can overlap
    them): where the engine's own default would schedule asynchronously (vLLM 0.32 on a GPU,
    TensorRT-LLM 1.2's overlap scheduler), that is turned off, and the note and ``spec`` say so;
    an explicit ``async_scheduling=true`` (``disable_overlap_scheduler=false``) is the caller's
    to refuse.

    ``host_copies``: copies of a KV block a CPU offloading tier keeps (vLLM's: one per TP rank, one
    where the ranks replicate it); None where the executor has no CPU tier (the real one), which
    refuses vLLM's offloading, TensorRT-LLM's host pool (sized per GPU, it ignores the copies) and
    SGLang's HiCache alike."""
    cls = get_policy_cls(spec.name)
    config = cls.default_config(device, max_model_len, **spec.flags)
    notes = cls.default_notes(device, config, spec.flags)
    for name, (off, note) in _OVERLAP_FLAGS.items():
        if (
            synchronous
            and getattr(config, name, off) != off
            and getattr(config, name) is not None
            and spec.flags.get(name) is None
        ):
            spec = PolicySpec(spec.name, {**spec.flags, name: off}, spec.engine_flags)
            config = cls.default_config(device, max_model_len, **spec.flags)
            # The engine's other start-up notes stay (SGLang's running cap with drafts).
            notes = [note.format(why=synchronous), *cls.default_notes(device, config, spec.flags)]
    flags = spec.engine_flags
    policy = with_fairness(
        make_policy(cls, config), flags.get("fairness", "none"), flags.get("tenant_weights", "")
    )
    size = size_kv(config)
    num_cpu_blocks = 0
    if cpu_swap:
        swap_gib = policy.kv_spec().swap_space_gib  # vLLM V0 --swap-space, GiB per GPU
        num_cpu_blocks = int(swap_gib * GIB // (size.block_size * size.kv_bytes_per_token))
    offload_gib = policy.kv_spec().offload_gib
    num_host_blocks = 0
    if offload_gib:
        if host_copies is None:  # the real executor's KV: no CPU tier behind it
            raise ValueError("kv_offloading_size (a CPU KV tier) needs the simulated executor (sim)")
        num_host_blocks = host_tier_chunks(
            offload_gib, size.block_size * size.kv_bytes_per_token, host_copies
        )
    host_cache_bytes = policy.kv_spec().host_cache_bytes
    if host_cache_bytes:
        if host_copies is None:  # the real executor's KV: no host pool behind it
            raise ValueError(
                "host_cache_size (TensorRT-LLM's host KV pool) needs the simulated executor (sim)"
            )
        # bytes per GPU, each rank's own pool of its own shards (resource_manager.py
        # calculate_max_num_blocks): the rank's bytes per token, whatever the TP degree
        num_host_blocks = secondary_pool_blocks(host_cache_bytes, size.kv_bytes_per_token, size.block_size)
    hicache = policy.kv_spec().hicache
    if hicache is not None:
        if host_copies is None:  # the real executor's KV: no host pool behind it
            raise ValueError(
                "enable_hierarchical_cache (SGLang's host KV tier) needs the simulated executor (sim)"
            )
        # Per rank, in tokens: each rank's host pool holds its own shard of the same tokens.
        num_host_blocks = hicache.host_tokens(
            size.num_blocks * size.block_size, size.kv_bytes_per_token, size.block_size
        )
    scheduler = make_scheduler(
        policy,
        size.num_blocks,
        size.block_size,
        num_cpu_blocks,
        max_model_len,
        shares_prefixes,
        num_host_blocks,
    )
    return SchedulerParts(spec, config, policy, size, num_cpu_blocks, max_model_len, scheduler, tuple(notes))
