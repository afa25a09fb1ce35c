"""GPU catalog: public peak figures of each accelerator (dense bf16, no sparsity).

Sources are the vendors' data sheets (SXM / OAM form factors where there is a choice).
Memory is what the driver reports, in GiB, because vLLM's device-based defaults compare GiB.
Interconnect is the per-GPU, per-direction bandwidth a ring all-reduce can use (NVLink /
Infinity Fabric; PCIe for cards without a GPU-to-GPU link).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.core.device import DeviceInfo

GB = 1e9


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # HBM bytes/s
    memory_gib: float  # device memory reported by the driver, GiB
    interconnect_bandwidth: float  # GPU-to-GPU bytes/s per direction
    pcie_bandwidth: float  # host-to-device bytes/s per direction (KV swap traffic)
    allreduce_latency: float = 8e-6  # seconds per collective (launch + sync, small messages)
    vendor: str = "nvidia"

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "memory_bandwidth",
            "memory_gib",
            "interconnect_bandwidth",
            "pcie_bandwidth",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name}: {name} must be > 0, got {getattr(self, name)}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def device_info(self) -> DeviceInfo:
        return DeviceInfo(self.name, self.memory_gib, self.vendor)


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        # A100 SXM: 312 TFLOP/s bf16, NVLink 3 600 GB/s total (300 per direction), PCIe 4 x16.
        Hardware("A100-40GB", 312e12, 1555 * GB, 40.0, 300 * GB, 32 * GB),
        Hardware("A100-80GB", 312e12, 2039 * GB, 80.0, 300 * GB, 32 * GB),
        # H100 SXM: 989 TFLOP/s bf16 dense, HBM3 3.35 TB/s, NVLink 4 900 GB/s, PCIe 5 x16.
        Hardware("H100-SXM", 989e12, 3350 * GB, 79.6, 450 * GB, 64 * GB),
        # H200 SXM: same compute as H100, HBM3e 4.8 TB/s, 141 GB.
        Hardware("H200", 989e12, 4800 * GB, 140.4, 450 * GB, 64 * GB),
        # L4: 121 TFLOP/s bf16 dense, 300 GB/s GDDR6, no NVLink (PCIe 4 x16 between cards).
        Hardware("L4", 121e12, 300 * GB, 22.5, 32 * GB, 32 * GB, allreduce_latency=20e-6),
        # L40S: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6, no NVLink.
        Hardware("L40S", 362e12, 864 * GB, 45.0, 32 * GB, 32 * GB, allreduce_latency=20e-6),
        # MI300X: 1307 TFLOP/s bf16 dense, 5.3 TB/s HBM3, 192 GB, Infinity Fabric 7 x 64 GB/s.
        Hardware("MI300X", 1307e12, 5300 * GB, 192.0, 448 * GB, 64 * GB, vendor="amd"),
    )
}

_ALIASES = {
    "A100": "A100-80GB",
    "A100-80G": "A100-80GB",
    "A100-SXM": "A100-80GB",
    "A100-40G": "A100-40GB",
    "H100": "H100-SXM",
    "H100-80GB": "H100-SXM",
    "H100-SXM5": "H100-SXM",
    "H200-SXM": "H200",
    "L40S-48GB": "L40S",
}


def resolve_hardware_name(name: str) -> str:
    """The catalog name for any accepted spelling (any case, dashes or underscores, the aliases
    above, an ``NVIDIA``/``AMD`` prefix); ValueError naming the catalog otherwise."""
    key = name.strip().upper().replace("_", "-").replace(" ", "-")
    for prefix in ("NVIDIA-", "AMD-"):
        key = key.removeprefix(prefix)
    by_upper = {known.upper(): known for known in HARDWARE}
    found = by_upper.get(key) or _ALIASES.get(key)
    if found is None:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
    return found


def get_hardware(name: str) -> Hardware:
    return HARDWARE[resolve_hardware_name(name)]
