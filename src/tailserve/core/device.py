"""What a policy needs to know about the device to pick its engine's defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    name: str  # catalog name, e.g. "A100-80GB"
    memory_gib: float  # per GPU
    vendor: str = "nvidia"

    @property
    def is_a100(self) -> bool:
        return self.name.upper().startswith("A100")
