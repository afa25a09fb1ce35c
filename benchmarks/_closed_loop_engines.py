"""The closed loop's engines and flag settings: how each real engine is started with a setting,
and the same setting as the simulator's ``vllm`` policy spec.

Both engines take vLLM's flag names: ``vllm serve`` (vLLM's CPU build, from its peer venv) and
``tailserve serve --executor torch --policy vllm`` (tailserve's own engine, whose scheduler is
the ``vllm`` policy the simulator runs). Each setting states every flag it relies on, so no
engine default (vLLM's CPU server: 2,048 tokens, 128 sequences) differs between the real run
and its prediction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_SEQS = 128  # vLLM's API-server default on CPUs (EngineArgs.get_batch_defaults)


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    budget: int  # max_num_batched_tokens
    max_seqs: int = DEFAULT_MAX_SEQS
    prefix_caching: bool = True
    chunked_prefill: bool = True

    def flags(self) -> list[str]:
        """The command-line flags, the same for both engines."""
        out = ["--max-num-batched-tokens", str(self.budget), "--max-num-seqs", str(self.max_seqs)]
        if not self.prefix_caching:
            out.append("--no-enable-prefix-caching")
        if not self.chunked_prefill:
            out.append("--no-enable-chunked-prefill")
        return out

    def policy(self) -> str:
        """The simulator's ``vllm`` policy with the same flags."""
        spec = f"vllm:max_num_batched_tokens={self.budget},max_num_seqs={self.max_seqs}"
        if not self.prefix_caching:
            spec += ",enable_prefix_caching=false"
        if not self.chunked_prefill:
            spec += ",enable_chunked_prefill=false"
        return spec


# The calibration's server runs the first (the engines' default budget); the rest in this order.
SETTINGS = (
    Setting("budget 2048", 2048),
    Setting("budget 256", 256),
    Setting("budget 512", 512),
    Setting("budget 8192", 8192),
    Setting("max_num_seqs 4", 2048, 4),
    Setting("prefix caching off", 2048, prefix_caching=False),
    Setting("chunked prefill off", 2048, chunked_prefill=False),
)
QUICK_SETTINGS = (SETTINGS[0], SETTINGS[1])


@dataclass(frozen=True, slots=True)
class Engine:
    name: str  # "vllm" or "tailserve"
    python: str
    model: Path
    served_name: str
    dtype: str
    max_model_len: int
    startup_timeout_s: float
    threads: int | None = None  # tailserve's --threads (None: its default, the free cores, revisited)

    def command(self, setting: Setting, port: int) -> list[str]:
        if self.name == "vllm":
            cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
            cmd += ["--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port)]
            # Stats logging stays on: --disable-log-stats would also drop the /metrics histograms
            # the calibration reads.
            cmd += ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--seed", "0"]
        else:
            cmd = [self.python, "-m", "tailserve.cli", "serve", "--model", str(self.model)]
            cmd += ["--served-model-name", self.served_name, "--port", str(port), "--executor", "torch"]
            cmd += ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--policy", "vllm"]
            cmd += ["--log-level", "warning"]
            if self.threads is not None:
                cmd += ["--threads", str(self.threads)]
        return cmd + setting.flags()

    def env(self, kvcache_gib: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.name == "vllm":
            env["VLLM_CPU_KVCACHE_SPACE"] = kvcache_gib
        else:
            src = str(Path(__file__).resolve().parents[1] / "src")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        return env
