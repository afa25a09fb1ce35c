"""Pipeline parallelism in the simulated executor: each stage's time and the send between stages.

A deployment of ``pp`` stages of ``tp`` GPUs each splits the decoder layers as vLLM does
(``get_pp_indices``, ``vllm/distributed/utils.py:126-166@v0.32.0``: ``L // pp`` each, the
remainder one layer apiece to the stages before the last, from the second-to-last back). A
micro-batch runs stage after stage; the engine core keeps several in flight
(``core/engine.py``, ``Engine._step_pipelined``), so stage ``k`` works on one batch while stage
``k + 1`` works on the one before.

A stage's time is its share of the whole model's step, by layers: the cost model prices the
step on one TP shard (``duration``: every layer, the LM head, the fixed overhead), the LM head
(``head``: ``CostModel.linear_time`` with and without the step's logits) runs on the last stage
only, and the fixed overhead is the host's part (the engine core's scheduling and the input
preparation), once per step before the first stage (``StepResult.host_time``). Attention, GEMMs,
the TP all-reduces and an MoE layer's exchange all scale with the layers a stage holds.

Between stages each TP rank sends its slice of the activations (vLLM's ``isend_tensor_dict`` with
the TP group as ``all_gather_group``: ``hidden_states`` and ``residual``, ``1 / tp`` of each per
rank, ``v1/worker/gpu_worker.py:1312-1357@v0.32.0``) and the receiving ranks all-gather them over
NVLink. The send is ``latency + bytes / bandwidth`` over the stages' link: NVLink when all
``tp x pp`` GPUs sit in one NVLink domain, else the network between nodes (``--pp-link``,
InfiniBand NDR by default). The constants are fitted to Vidur's measured NCCL send/recv on DGX
H100 and A100 (``../shared/profiles/vidur/network/{h100,a100}_dgx/send_recv.csv``, 994 sizes
from 2 KiB to 64 MiB each; ``python -m benchmarks.pp_send_recv`` refits them and prints the
agreement): over NVLink the GPU's own fit (H100: 7.6 us + bytes / 357.5 GB/s, 79% of its 450
GB/s; A100: 13.2 us + bytes / 285.8 GB/s), other GPUs at H100's fraction of their NVLink;
over the network H100's fit across two nodes (19.1 us + bytes / 35.9 GB/s, 72% of 400 Gb/s
InfiniBand) scaled to the link's line rate.

Not modelled: the sampled tokens' broadcast from the last stage back to the first (under async
scheduling; a few bytes a request), uneven stage memory (the KV cache is sized for the stage
with the most layers, counting both embedding matrices: ``ModelSpec.pipeline_stage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.executors.simulated.hardware import LINKS, Hardware
from tailserve.executors.simulated.models import ModelSpec

# Fitted by benchmarks/pp_send_recv.py (least squares of the relative error over Vidur's 994
# sizes each): (latency s, bytes/s) of one NCCL send/recv between two GPUs of one DGX node.
NVLINK_FITS: dict[str, tuple[float, float]] = {
    "H100-SXM": (7.6e-6, 357.5e9),
    "A100-80GB": (13.2e-6, 285.8e9),
    "A100-40GB": (13.2e-6, 285.8e9),
}
NVLINK_EFFICIENCY = 357.5e9 / 450e9  # H100's fit over its NVLink line rate, for other GPUs
NVLINK_LATENCY = 7.6e-6
# Two DGX H100 nodes over 400 Gb/s InfiniBand (one NIC per GPU): 19.1 us + bytes / 35.9 GB/s.
NETWORK_EFFICIENCY = 35.9e9 / 50e9
NETWORK_LATENCY = 19.1e-6
# --pp-link choices: "auto" (NVLink inside one NVLink domain, else ib-ndr), or the network
# between the stages' nodes (hardware.LINKS), given when they are on separate nodes.
PP_LINKS = ("auto", "ib-ndr", "ib-hdr", "roce-400g", "roce-100g")
ACTIVATIONS_PER_TOKEN = 2  # hidden_states and residual, each hidden_size wide


def pp_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, as vLLM's ``get_pp_indices`` splits them (no VLLM_PP_LAYER_PARTITION)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size must be in 1..{num_layers} (the model's layers), got {pp}")
    layers = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        layers[-i] += 1
    return tuple(layers)


@dataclass(frozen=True, slots=True)
class SendLink:
    name: str
    latency: float  # seconds per send
    bandwidth: float  # bytes/s per GPU

    def time(self, num_bytes: float) -> float:
        return self.latency + num_bytes / self.bandwidth


def nvlink(hardware: Hardware) -> SendLink:
    """A send between two GPUs of one node: the GPU's fit, or H100's fraction of its NVLink."""
    fit = NVLINK_FITS.get(hardware.name)
    if fit is not None:
        return SendLink(f"NVLink ({hardware.name}, fitted)", *fit)
    return SendLink(
        f"NVLink ({hardware.name})", NVLINK_LATENCY, hardware.interconnect_bandwidth * NVLINK_EFFICIENCY
    )


def resolved_stage_link(nvlink_domain: int, tp: int, pp: int, network: str) -> str:
    """ "nvlink", or the network the stages are joined by (``stage_link``'s choice, by name)."""
    if network == "auto":
        return "nvlink" if tp * pp <= nvlink_domain else "ib-ndr"
    return network


def stage_link(hardware: Hardware, tp: int, pp: int, network: str = "auto") -> SendLink:
    """The link between stages, at H100's measured fraction of a network's line rate: ``network``
    (a name of ``PP_LINKS``) when given — the stages on separate nodes, as the Sarathi-Serve
    paper's Falcon-180B ran on two nodes of four A100s over 100 Gb Ethernet — or, "auto", NVLink
    while ``tp x pp`` GPUs fit one NVLink domain and InfiniBand NDR past it."""
    if network not in PP_LINKS:
        raise ValueError(f"unknown --pp-link {network!r}; known: {', '.join(PP_LINKS)}")
    name = resolved_stage_link(hardware.nvlink_domain, tp, pp, network)
    if name == "nvlink":
        return nvlink(hardware)
    link = LINKS[name]
    return SendLink(f"{name} ({link.note})", NETWORK_LATENCY, link.bandwidth * NETWORK_EFFICIENCY)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The stages of one deployment: layers each, and the send between two of them."""

    layers: tuple[int, ...]
    link: SendLink
    gather: SendLink | None  # the receiving TP ranks' all-gather (None at TP 1)
    bytes_per_token: float  # activations one TP rank sends per token
    tp: int

    @classmethod
    def of(cls, model: ModelSpec, hardware: Hardware, tp: int, pp: int, network: str = "auto") -> Pipeline:
        per_token = ACTIVATIONS_PER_TOKEN * model.hidden_size * model.dtype_bytes
        return cls(
            pp_partition(model.num_layers, pp),
            stage_link(hardware, tp, pp, network),
            nvlink(hardware) if tp > 1 else None,
            per_token / tp,
            tp,
        )

    @property
    def pp(self) -> int:
        return len(self.layers)

    def send_time(self, num_tokens: int) -> float:
        """Seconds from a stage's end to the next stage holding its activations."""
        nbytes = num_tokens * self.bytes_per_token
        t = self.link.time(nbytes)
        if self.gather is not None:
            t += self.gather.time(nbytes * (self.tp - 1))
        return t

    def stage_times(self, work: float, head: float) -> tuple[float, ...]:
        """Each stage's seconds for a step whose forward pass takes ``work`` on one TP shard of
        the whole model, ``head`` of it the LM head (the last stage's)."""
        layers = work - head
        total = sum(self.layers)
        times = [layers * n / total for n in self.layers]
        times[-1] += head
        return tuple(times)


def pipeline_note(cost_model: object) -> str:
    """The run's note: the stages, their layers and the link between them, in one line."""
    pipe: Pipeline = cost_model.pipeline  # type: ignore[attr-defined]
    tp = cost_model.tp  # type: ignore[attr-defined]
    layers = pipe.layers
    split = f"{layers[0]} layers each" if len(set(layers)) == 1 else f"layers {'/'.join(map(str, layers))}"
    return (
        f"pipeline parallelism: {pipe.pp} stages of TP {tp} ({split}); between stages "
        f"{pipe.link.name}, {pipe.link.latency * 1e6:.1f} us + bytes at {pipe.link.bandwidth / 1e9:.1f} GB/s "
        f"({pipe.bytes_per_token:,.0f} bytes a token per GPU)"
    )
