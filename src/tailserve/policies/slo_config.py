"""The ``slo`` policy's flags (``SloConfig``) and what it keeps per waiting request."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.policies.fairness import make_backlog
from tailserve.policies.slo_classes import DEFAULT_SLO_CLASSES, SloClass, parse_slo_classes
from tailserve.policies.tenant_share import PROTECT_BELOW

ADMISSIONS = ("best-effort", "reject")
PROTECTED_ORDERS = ("arrival", "slack")


@dataclass(frozen=True, slots=True)
class SloConfig:
    max_num_batched_tokens: int  # tokens per iteration at most, whatever the slack
    max_num_seqs: int
    slo_classes: str = DEFAULT_SLO_CLASSES
    slo_admission: str = field(default="best-effort", metadata={"choices": ADMISSIONS})
    aging_s: float = 10.0  # seconds a best-effort request waits before it goes first
    # Rule 5: the share of the prefill tokens that aged requests may take ahead of feasible ones
    # (1: aged requests always go first).
    aging_share: float = 0.1
    min_prefill_tokens: int = 64  # prefill tokens allowed per iteration even without slack
    fairness: str = "none"  # or "vtc"
    tenant_weights: str = ""  # a=2,b=1 (fairness=vtc)
    # Rule 10 (fairness=vtc): an over-share tenant's decode sits out a protected tenant's
    # prefill iterations while its gap since its last token is under this many TBT targets.
    yield_tbts: float = 2.0  # 0: rule 10 off
    # Rule 11 (fairness=vtc): while a protected tenant runs, an over-share tenant's chunk keeps
    # the iteration within this many of the protected tenant's (smallest) TBT target.
    quantum_tbts: float = 0.5  # 0: rule 11 off
    # Rule 9 (fairness=vtc): a protected tenant stays protected until its recent service reaches
    # this fraction of its fair share (it becomes protected under half of it); 0.5: no hold.
    protect_until: float = 1.0
    # Rule 9: a protected tenant's feasible waiting requests in "arrival" order, or "slack" (rule 3's).
    protected_order: str = field(default="arrival", metadata={"choices": PROTECTED_ORDERS})
    tbt_late_fraction: float = 0.0  # experiment (slo_burst.py): share of gaps allowed late on bursts
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.slo_admission not in ADMISSIONS:
            raise ValueError(f"slo_admission must be best-effort or reject, got {self.slo_admission!r}")
        if not self.aging_s > 0:
            raise ValueError(f"aging_s must be > 0 seconds, got {self.aging_s}")
        if not 0 < self.aging_share <= 1:
            raise ValueError(f"aging_share must be a fraction in (0, 1], got {self.aging_share}")
        if not self.yield_tbts >= 0 or self.yield_tbts == float("inf"):
            raise ValueError(f"yield_tbts must be a finite number of TBT targets >= 0, got {self.yield_tbts}")
        if not self.quantum_tbts >= 0 or self.quantum_tbts == float("inf"):
            raise ValueError(
                f"quantum_tbts must be a finite number of TBT targets >= 0, got {self.quantum_tbts}"
            )
        if not PROTECT_BELOW <= self.protect_until <= 1:
            raise ValueError(
                f"protect_until must be a fraction of the fair share in [{PROTECT_BELOW:g}, 1], got {self.protect_until}"
            )
        if self.protected_order not in PROTECTED_ORDERS:
            raise ValueError(f"protected_order must be arrival or slack, got {self.protected_order!r}")
        if not 0 <= self.tbt_late_fraction < 1:
            raise ValueError(f"tbt_late_fraction must be in [0, 1), got {self.tbt_late_fraction}")
        if self.min_prefill_tokens < 1:
            raise ValueError(f"min_prefill_tokens must be >= 1, got {self.min_prefill_tokens}")
        parse_slo_classes(self.slo_classes)
        make_backlog(self.fairness, self.tenant_weights)


@dataclass(slots=True)
class WaitingInfo:
    """What ordering needs of a waiting request, computed when it (re-)enters the queue."""

    slo: SloClass
    deadline: float  # seconds on the engine clock
    prefill_s: float  # predicted prefill of its uncached tokens, alone
