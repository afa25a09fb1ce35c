"""The ``sglang`` policy's flags (``SglangConfig``: SGLang's ``ServerArgs`` names and defaults)
and the choices they take. Apart from ``sglang.py`` so that the policy's parts (the queue order
in ``sglang_priority.py``) can read the flags without importing the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.kv.hicache_spec import DEFAULT_HICACHE_RATIO, HiCacheSpec
from tailserve.policies.sglang_spec import check_speculative

# SGLang's ``CacheAgnosticPolicy`` and ``CacheAwarePolicy`` enums (``schedule_policy.py``); the
# parser's ninth choice, ``priority``, is in neither and stops the scheduler at start.
SCHEDULE_POLICIES = (
    "fcfs", "lpm", "dfs-weight", "lof", "random", "hrrn", "shortest-prefill-first", "routing-key",
)  # fmt: skip
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight", "hrrn", "shortest-prefill-first")
# Cache-aware policies that skip the matching (and keep the queue) above 128 waiting
# (``_determine_active_policy``); dfs-weight and shortest-prefill-first always match.
LARGE_QUEUE_FCFS_POLICIES = ("lpm", "hrrn")
RETRACTION_POLICIES = ("length", "priority")
# ``--disaggregation-mode``: "null" (one server), or one side of a prefill/decode pair, set by the
# P/D simulation itself (``cluster/sglang_pd.py``); a single engine refuses the other two.
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DECODE_ALLOCATION_POLICIES = ("early", "prefill_complete")

# Fields of features off by default: a run file names them only when set (sim/run.py).
_WHEN_SET = {"recorded_when_set": True}


@dataclass(frozen=True, slots=True)
class SglangConfig:
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int = 4096  # tokens; <= 0 disables chunking; 4096 is SGLang's unknown-GPU default
    max_prefill_tokens: int = 16384  # tokens per prefill batch
    schedule_conservativeness: float = 1.0
    enable_mixed_chunk: bool = False
    max_running_requests: int | None = (
        None  # None = auto from the KV capacity (``auto_max_running_requests``)
    )
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    retraction_policy: str = "length"
    disable_radix_cache: bool = False  # True: no prefix sharing, lpm/dfs-weight/hrrn become fcfs
    lpm_aging_rate: float = 0.0  # lpm: tokens of priority per second waited (0 = SGLang's plain lpm)
    random_seed: int = 0  # seeds ``schedule_policy=random``
    assume_ignore_eos: bool = False  # reserve running requests' outputs at ratio 1.0
    # Speculative decoding (SGLang's --speculative-* flags; policies/sglang_spec.py): EAGLE,
    # EAGLE3 or NEXTN (DeepSeek's MTP layer), a chain of drafts (topk 1)
    speculative_algorithm: str | None = field(default=None, metadata=_WHEN_SET)
    # draft steps per decode (none: SGLang's auto choice, 3)
    speculative_num_steps: int | None = field(default=None, metadata=_WHEN_SET)
    # drafts per step: only 1 (a chain) is modelled
    speculative_eagle_topk: int | None = field(default=None, metadata=_WHEN_SET)
    # tokens one verification computes: SGLang forces steps + 1 with topk 1
    speculative_num_draft_tokens: int | None = field(default=None, metadata=_WHEN_SET)
    # per-position unconditional acceptance rates, one per draft step (as vllm's); 0.8/0.5/0.3
    synthetic_acceptance_rates: tuple[float, ...] | None = field(default=None, metadata=_WHEN_SET)
    # or the mean acceptance length: 1 + accepted drafts per verification, in [1, steps + 1]
    synthetic_acceptance_length: float | None = field(default=None, metadata=_WHEN_SET)
    # SGLang's --disable-overlap-schedule (policies/sglang_overlap.py). None: as SGLang 0.5.23
    # decides (overlap on on a GPU, with speculative decoding too: spec v2; tailserve steps
    # synchronously on its real and real-time executors: sglang_overlap.overlap_default)
    disable_overlap_schedule: bool | None = field(default=None, metadata=_WHEN_SET)
    # HiCache (policies/sglang_hicache.py, kv/hiradix.py): a host-memory tier behind the radix
    # cache; its host pool per rank is hicache_size GB when > 0, else the device pool x
    # hicache_ratio (None: SGLang's default, 2.0); write_through, write_through_selective or
    # write_back
    enable_hierarchical_cache: bool = field(default=False, metadata=_WHEN_SET)
    hicache_ratio: float | None = field(default=None, metadata=_WHEN_SET)
    hicache_size: int = field(default=0, metadata=_WHEN_SET)
    hicache_write_policy: str = field(default="write_through", metadata=_WHEN_SET)
    # P/D (policies/sglang_decode.py): which side of a pair this server is; the decode server's
    # KV reserve per active request at pre-allocation (num_reserved_decode_tokens), its request
    # slots past max_running_requests for requests in transfer (None: SGLang's rule, 2 x a running
    # cap <= 32, else 0), how many turns apart it polls its queues, and when it reserves a
    # request's KV ("early": before its prefill may start; "prefill_complete": once its prefill
    # is done, the prefill server holding the KV until then)
    disaggregation_mode: str = field(default="null", metadata=_WHEN_SET)
    disaggregation_decode_allocation_policy: str = field(default="early", metadata=_WHEN_SET)
    num_reserved_decode_tokens: int = field(default=512, metadata=_WHEN_SET)
    disaggregation_decode_extra_slots: int | None = field(default=None, metadata=_WHEN_SET)
    disaggregation_decode_polling_interval: int = field(default=1, metadata=_WHEN_SET)
    # Load and cadence (policies/sglang_load.py). A request entering a waiting queue of this many
    # is refused with HTTP 503 (under priority scheduling a less urgent waiting one may leave
    # instead); none: no limit
    max_queued_requests: int | None = field(default=None, metadata=_WHEN_SET)
    # the most requests in one prefill batch, a continuing chunk included; none: no limit
    prefill_max_requests: int | None = field(default=None, metadata=_WHEN_SET)
    # scheduler turns without a prefill pass after each prefill batch; none or 0: off (SGLang's
    # default, but 22 for Qwen3-VL on Hopper)
    prefill_decode_interval: int | None = field(default=None, metadata=_WHEN_SET)
    # prefill_decode_interval applies while at least this many requests decode
    prefill_decode_interval_min_bs: int = field(default=0, metadata=_WHEN_SET)
    # Tokens the scheduler holds per streamed chunk (core/stream_interval.py): the client's ITL,
    # not the scheduler's turns
    stream_interval: int = field(default=1, metadata=_WHEN_SET)

    def __post_init__(self) -> None:
        if self.disable_overlap_schedule not in (None, True, False):
            raise ValueError(
                f"disable_overlap_schedule must be true or false, got {self.disable_overlap_schedule!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy {self.schedule_policy!r} is not modelled; known: {', '.join(SCHEDULE_POLICIES)}"
            )
        if self.schedule_policy == "shortest-prefill-first" and self.disable_radix_cache:
            # ``_validate_and_adjust_policy``: the one cache-aware policy that does not fall back
            # to fcfs without the cache; SGLang's scheduler stops at start.
            raise ValueError(
                "schedule_policy shortest-prefill-first requires the radix cache (disable_radix_cache=False)"
            )
        if self.retraction_policy not in RETRACTION_POLICIES:
            raise ValueError(
                f"retraction_policy must be one of {', '.join(RETRACTION_POLICIES)}, got {self.retraction_policy!r}"
            )
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.schedule_conservativeness < 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")
        if self.lpm_aging_rate < 0:
            raise ValueError(f"lpm_aging_rate must be >= 0, got {self.lpm_aging_rate}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(
                f"max_running_requests must be >= 1 (or None: auto), got {self.max_running_requests}"
            )
        self._check_hicache()
        self._check_disaggregation()
        self._check_load_limits()
        check_speculative(
            self.speculative_algorithm,
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
            self.synthetic_acceptance_rates,
            self.synthetic_acceptance_length,
            self.enable_mixed_chunk and self.chunking,
        )

    def _check_hicache(self) -> None:
        # The host tier's own checks, with or without the tier on (a bad value is refused either way).
        ratio = DEFAULT_HICACHE_RATIO if self.hicache_ratio is None else self.hicache_ratio
        HiCacheSpec(ratio, self.hicache_size, self.hicache_write_policy)
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            # arg_groups/kv_cache_hook.py:393-397@v0.5.23
            raise ValueError("enable_hierarchical_cache and disable_radix_cache are mutually exclusive")

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_decode_allocation_policy not in DECODE_ALLOCATION_POLICIES:
            raise ValueError(
                "disaggregation_decode_allocation_policy must be one of "
                f"{', '.join(DECODE_ALLOCATION_POLICIES)}, got {self.disaggregation_decode_allocation_policy!r}"
            )
        if self.num_reserved_decode_tokens < 0:
            raise ValueError(
                f"num_reserved_decode_tokens must be >= 0, got {self.num_reserved_decode_tokens}"
            )
        if self.disaggregation_decode_extra_slots is not None and self.disaggregation_decode_extra_slots < 0:
            raise ValueError(
                f"disaggregation_decode_extra_slots must be >= 0, got {self.disaggregation_decode_extra_slots}"
            )
        if self.disaggregation_decode_polling_interval < 1:
            raise ValueError(
                "disaggregation_decode_polling_interval must be >= 1, got "
                f"{self.disaggregation_decode_polling_interval}"
            )
        if self.disaggregation_mode == "decode" and self.enable_hierarchical_cache:
            raise ValueError("HiCache on the decode server of a P/D pair is not modelled")

    def _check_load_limits(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(
                f"max_queued_requests must be >= 0 (or None: unbounded), got {self.max_queued_requests}"
            )
        if self.prefill_max_requests is not None and self.prefill_max_requests < 1:
            # SGLang accepts 0 and then never admits anyone (add_one_req returns OTHER at once).
            raise ValueError(
                f"prefill_max_requests must be >= 1 (or None: no limit), got {self.prefill_max_requests}"
            )
        # validation_hook.validate_prefill_decode_interval@v0.5.23
        if self.prefill_decode_interval is not None and self.prefill_decode_interval < 0:
            raise ValueError("--prefill-decode-interval must be non-negative.")
        if self.prefill_decode_interval_min_bs < 0:
            raise ValueError("--prefill-decode-interval-min-bs must be non-negative.")

    @property
    def decode_interval(self) -> int:
        """Scheduler turns the next prefill waits after a prefill batch (0: off). SGLang keeps
        the countdown in ``get_next_batch_to_run``, which a prefill server of a P/D pair does not
        run (``event_loop_normal_disagg_prefill`` calls ``get_new_batch_prefill``)."""
        if self.disaggregation_mode != "null":
            return 0
        return self.prefill_decode_interval or 0

    @property
    def chunking(self) -> bool:
        return self.chunked_prefill_size > 0
