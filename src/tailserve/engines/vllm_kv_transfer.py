"""vLLM's ``--kv-transfer-config``: which KV connector a launch line builds, and what tailserve
makes of it (vLLM 0.32: ``vllm/config/kv_transfer.py``, the connectors' own extra-config keys).

- ``OffloadingConnector`` with the default ``CPUOffloadingSpec`` is the CPU tier that
  ``--kv-offloading-size`` builds (``vllm/config/vllm.py:1105-1136``: ``cpu_bytes_to_use`` =
  the GiB x 2^30): simulated as ``kv_offloading_size``; its keys tailserve does not model
  (another spec, chunks of several blocks, ``store_threshold``, the ARC policy) are named.
- ``NixlConnector`` (pull mode) is one side of a P/D pair: ``kv_producer`` a prefill instance,
  ``kv_consumer`` a decode instance. A pair is simulated from its two launch lines
  (``--prefill-engine-cmd`` / ``--decode-engine-cmd`` with ``--prefill-replicas`` /
  ``--decode-replicas``: ``cluster/vllm_pd.py``), not from one engine's line.
- Any other connector (push mode, LMCache, Mooncake, P2P NCCL, a module path) is not modelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tailserve.engines.flag_spec import NOT_MODELLED, SCHEDULING, Finding, Given

SOURCE = "vllm/config/kv_transfer.py@v0.32.0"
_OFFLOAD_SOURCE = "vllm/v1/kv_offload/cpu/spec.py@v0.32.0"
_NIXL_SOURCE = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py@v0.32.0"
_NIXL = ("NixlConnector", "NixlPullConnector")
# The OffloadingConnector keys tailserve simulates as given or at the value it assumes.
_OFFLOAD_READ = {"cpu_bytes_to_use", "spec_name", "offload_prompt_only", "eviction_policy"}
# NixlConnector keys that change nothing tailserve prices (threads, handshakes, TTLs of blocks
# only a bidirectional transfer keeps).
_NIXL_NEUTRAL = {"num_threads", "backends", "enforce_handshake_compat", "engine_ttl"}


@dataclass(frozen=True, slots=True)
class KvTransfer:
    connector: str | None
    role: str | None
    extra: dict[str, Any] = field(default_factory=dict)


def parse(value: Any) -> KvTransfer:
    """The config as vLLM reads it (a JSON object, or already a dict); ValueError otherwise."""
    config = json.loads(value) if isinstance(value, str) else value
    if not isinstance(config, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, got {value!r}")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    return KvTransfer(config.get("kv_connector"), config.get("kv_role"), dict(extra))


def offloading_gib(value: Any) -> float | None:
    """The CPU tier's GiB when the config is vLLM's native offloading tier as tailserve
    simulates it (``kv_offloading_size``), else None."""
    try:
        return _tier_gib(parse(value))
    except ValueError:
        return None


def _tier_gib(config: KvTransfer) -> float | None:
    extra = config.extra
    if (
        config.connector != "OffloadingConnector"
        or extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec"
    ):
        return None
    try:
        size = float(extra.get("cpu_bytes_to_use") or 0)
    except (TypeError, ValueError):
        return None
    return size / (1 << 30) if size > 0 else None


def kv_transfer_rule(given: Given) -> list[Finding]:
    """The verdict on ``--kv-transfer-config`` by the connector it names (module docstring)."""
    value = given.get("kv_transfer_config")
    if value is None:
        return []
    try:
        config = parse(value)
    except ValueError as e:
        return [Finding(("kv_transfer_config",), NOT_MODELLED, f"{e}: not read", SOURCE)]
    name, extra = config.connector, config.extra
    if name == "OffloadingConnector":
        gib = _tier_gib(config)
        if gib is None:
            why = (
                "needs cpu_bytes_to_use in kv_connector_extra_config"
                if extra.get("spec_name", "CPUOffloadingSpec") == "CPUOffloadingSpec"
                else f"spec {extra.get('spec_name')}"
            )
            return [Finding(("kv_transfer_config",), NOT_MODELLED, f"an offloading connector ({why}); not simulated",
                            _OFFLOAD_SOURCE)]  # fmt: skip
        left = sorted(k for k in extra if k not in _OFFLOAD_READ)
        eviction = extra.get("eviction_policy", "lru")
        if eviction != "lru":
            left.append(f"eviction_policy={eviction}")
        what = (
            f"vLLM's native CPU tier, as --kv-offloading-size {gib:g} builds it: simulated as "
            f"kv_offloading_size={gib:g} (GiB over all TP ranks)"
        )
        if left:
            what += f"; not modelled: {', '.join(left)}"
        return [Finding(("kv_transfer_config",), SCHEDULING, what, _OFFLOAD_SOURCE)]
    if name in _NIXL:
        side = {
            "kv_producer": "a P/D prefill instance: it keeps each prompt's KV until the decode side reads it",
            "kv_consumer": "a P/D decode instance: it reads each prompt's KV from the prefill side once it admits it",
            "kv_both": "either side of a P/D pair (kv_both is deprecated with NixlConnector)",
        }.get(str(config.role), f"kv_role {config.role!r}")
        left = sorted(k for k in extra if k not in _NIXL_NEUTRAL)
        what = (
            f"NixlConnector (pull), {side}; tailserve simulates vLLM's pair from its two launch lines "
            "(--prefill-engine-cmd / --decode-engine-cmd with --prefill-replicas / --decode-replicas), "
            "not on one engine's line"
        )
        if left:
            what += f"; not modelled: {', '.join(left)}"
        return [Finding(("kv_transfer_config",), NOT_MODELLED, what, _NIXL_SOURCE)]
    what = f"the {name or 'unnamed'} KV connector is not simulated"
    if name == "NixlPushConnector":
        what = "NixlConnector in push mode (the prefill side writes to the decode side): not simulated"
    return [Finding(("kv_transfer_config",), NOT_MODELLED, what, SOURCE)]
