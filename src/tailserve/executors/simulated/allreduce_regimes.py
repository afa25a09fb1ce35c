"""Which all-reduce kernel vLLM runs for a TP group's message: its choice, rule by rule.

vLLM does not run one algorithm. ``CudaCommunicator.all_reduce`` tries, in order (defaults, one
node with NVLink, bf16, no environment overrides):

1. FlashInfer's all-reduce (vLLM >= 0.31, ``VLLM_ALLREDUCE_USE_FLASHINFER`` on by default,
   vllm/envs.py:1916@v0.31.0, vllm/envs.py:1971@v0.32.0; off at vllm/envs.py:1676@v0.24.0) for
   messages of at most ``FI_ALLREDUCE_FUSION_MAX_SIZE_MB[capability][tp]``
   (vllm/compilation/passes/fusion/allreduce_rms_fusion.py:104@v0.31.0, same table @v0.32.0;
   ``input_tensor.nbytes > self.max_workspace_size`` refuses,
   vllm/distributed/device_communicators/flashinfer_all_reduce.py:452@v0.31.0, :489@v0.32.0).
   vLLM's backend there is FlashInfer's MNNVL kernel on one NVSwitch node
   (flashinfer_all_reduce.py:165@v0.31.0, :163@v0.32.0), called without ``use_oneshot``, so
   FlashInfer picks (flashinfer/comm/trtllm_mnnvl_ar.py:44,51@flashinfer-python-0.7.0.post1, the
   version both pin): one shot while ``bytes x TP <= 1 MiB``, two shots above;
2. NCCL's symmetric-memory all-reduce only with ``VLLM_USE_NCCL_SYMM_MEM`` (off by default,
   vllm/envs.py:1785@v0.24.0, :2041@v0.31.0, :2100@v0.32.0): never here;
3. the custom all-reduce below its ``max_size`` (``inp_size < self.max_size``,
   vllm/distributed/device_communicators/custom_all_reduce.py:242@v0.24.0, :507@v0.31.0,
   :513@v0.32.0): 8 MiB (custom_all_reduce.py:59@v0.24.0, :140@v0.31.0, :141@v0.32.0) lowered to
   ``CUSTOM_ALL_REDUCE_MAX_SIZES[capability][tp]`` where torch symmetric memory is on (its default,
   ``VLLM_ALLREDUCE_USE_SYMM_MEM``; custom_all_reduce.py:130@v0.24.0, :245@v0.31.0, :251@v0.32.0;
   the table vllm/distributed/device_communicators/all_reduce_utils.py:31@v0.24.0, same at
   v0.31.0 and v0.32.0). Its kernel (csrc/custom_all_reduce.cuh:589-596@v0.24.0,
   :298-305@v0.31.0 and @v0.32.0): one stage at TP 2 always; else one stage below 512 KiB at
   TP <= 4 or below 256 KiB at TP <= 8, two stages above;
4. torch symmetric memory up to ``SYMM_MEM_ALL_REDUCE_MAX_SIZES[capability][tp]``
   (``inp_size <= self.max_size``, symm_mem.py:124@v0.24.0, :125@v0.31.0 and @v0.32.0; the
   table all_reduce_utils.py:52@v0.24.0, :58@v0.31.0 and @v0.32.0): multimem (NVLink SHARP) at
   the TP degrees ``_WORLD_SIZES_MULTIMEM`` lists (symm_mem.py:26 in all three), two-shot at
   the others;
5. NCCL (pynccl) above all of them.

The order itself: vllm/distributed/device_communicators/cuda_communicator.py:254@v0.24.0,
:335@v0.31.0, :362@v0.32.0 (``def all_reduce``). Under CUDA graphs (vLLM's decode) the custom
kernel reads registered graph buffers; the tables AISimulate measured are that path (its
collector calls ``tensor_model_parallel_all_reduce`` inside vLLM's ``graph_capture``), so every
step of this order shows in them.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * 1024
CUSTOM_DEFAULT_MAX = 8 * MIB  # custom_all_reduce.py's max_size argument

# the kernels, in the order vLLM tries them
REGIMES = (
    "flashinfer_oneshot",
    "flashinfer_twoshot",
    "custom_1stage",
    "custom_2stage",
    "symm_multimem",
    "symm_two_shot",
    "nccl",
)

# CUDA compute capability per catalog GPU (as vLLM's tables key it)
GPU_CAPABILITY = {"H100-SXM": "9.0", "H200": "9.0", "H20": "9.0", "B200": "10.0", "GB200": "10.0",
                  "B300": "10.3", "GB300": "10.3"}  # fmt: skip

# trtllm_mnnvl_ar.py MNNVL_ONE_SHOT_THRESHOLD: one shot while bytes x TP is at most this
FLASHINFER_ONESHOT_MAX = 64 * 1024 * 8 * 2
# all_reduce_utils.py CUSTOM_ALL_REDUCE_MAX_SIZES (same values at v0.24.0, v0.31.0, v0.32.0)
CUSTOM_MAX = {
    "9.0": {2: 64 * MIB, 4: 32 * MIB, 6: MIB // 2, 8: MIB // 4},
    "10.0": {2: 2 * MIB, 4: 2 * MIB, 6: 1 * MIB, 8: 1 * MIB},
    "10.3": {2: 4 * MIB, 4: 4 * MIB, 6: 8 * MIB, 8: 4 * MIB},
}
# all_reduce_utils.py SYMM_MEM_ALL_REDUCE_MAX_SIZES (same values at v0.24.0, v0.31.0, v0.32.0)
SYMM_MAX = {
    "9.0": {2: 64 * MIB, 4: 32 * MIB, 6: 64 * MIB, 8: 64 * MIB},
    "10.0": {2: 8 * MIB, 4: 32 * MIB, 6: 128 * MIB, 8: 128 * MIB},
    "10.3": {2: 4 * MIB, 4: 32 * MIB, 6: 32 * MIB, 8: 64 * MIB},
}
# symm_mem.py _WORLD_SIZES_MULTIMEM
MULTIMEM_TP = {"9.0": (4, 6, 8), "10.0": (6, 8), "10.3": (6, 8)}
# allreduce_rms_fusion.py FI_ALLREDUCE_FUSION_MAX_SIZE_MB (v0.31.0 = v0.32.0), in bytes
FLASHINFER_MAX = {
    "9.0": {2: 64 * MIB, 4: 2 * MIB, 8: MIB // 2},
    "10.0": {2: 64 * MIB, 4: 32 * MIB, 8: 1 * MIB},
    "10.3": {2: 64 * MIB, 4: 64 * MIB, 8: 4 * MIB},
}


@dataclass(frozen=True, slots=True)
class VllmAllReduce:
    """vLLM's all-reduce choice at one version: whether FlashInfer's kernel comes first."""

    version: str
    flashinfer: bool  # VLLM_ALLREDUCE_USE_FLASHINFER's default

    def regime(self, capability: str, tp: int, nbytes: int) -> str:
        """The kernel vLLM runs for an all-reduce of ``nbytes`` bytes over ``tp`` GPUs."""
        if capability not in CUSTOM_MAX:
            raise ValueError(f"no vLLM all-reduce rules for compute capability {capability!r}")
        if tp < 2:
            raise ValueError(f"an all-reduce needs at least 2 GPUs, got tp={tp}")
        fi_max = FLASHINFER_MAX[capability].get(tp) if self.flashinfer else None
        if fi_max is not None and nbytes <= fi_max:
            return "flashinfer_oneshot" if nbytes * tp <= FLASHINFER_ONESHOT_MAX else "flashinfer_twoshot"
        if tp <= 8 and nbytes % 16 == 0:
            ca_max = min(CUSTOM_MAX[capability].get(tp, CUSTOM_DEFAULT_MAX), CUSTOM_DEFAULT_MAX)
            if nbytes < ca_max:
                one = tp == 2 or (tp <= 4 and nbytes < 512 * KIB) or (tp <= 8 and nbytes < 256 * KIB)
                return "custom_1stage" if one else "custom_2stage"
        symm_max = SYMM_MAX[capability].get(tp)
        if symm_max is not None and nbytes <= symm_max:
            return "symm_multimem" if tp in MULTIMEM_TP[capability] else "symm_two_shot"
        return "nccl"

    def edges(self, capability: str, tp: int, top: int = 1 << 40) -> tuple[tuple[str, int], ...]:
        """The regimes a growing message passes through at ``tp``, each with the largest byte
        count (a multiple of 16) it covers, ascending; the last one covers everything above."""
        points = {16, top, FLASHINFER_ONESHOT_MAX // tp, FLASHINFER_ONESHOT_MAX // tp + 16}
        for table in (CUSTOM_MAX, SYMM_MAX, FLASHINFER_MAX):
            points.update(v + d for v in table[capability].values() for d in (-16, 0, 16))
        points.update((CUSTOM_DEFAULT_MAX - 16, CUSTOM_DEFAULT_MAX, 256 * KIB - 16, 256 * KIB,
                       512 * KIB - 16, 512 * KIB))  # fmt: skip
        out: list[tuple[str, int]] = []
        for p in sorted(b for b in points if 0 < b <= top and b % 16 == 0):
            r = self.regime(capability, tp, p)
            if out and out[-1][0] == r:
                out[-1] = (r, p)
            else:
                out.append((r, p))
        return tuple(out)


# the versions whose tables tailserve reads, and the one it follows
VLLM_ALLREDUCE = {
    "0.24.0": VllmAllReduce("0.24.0", flashinfer=False),
    "0.31.0": VllmAllReduce("0.31.0", flashinfer=True),
    "0.32.0": VllmAllReduce("0.32.0", flashinfer=True),
}


def vllm_allreduce(version: str) -> VllmAllReduce:
    """The rules of one vLLM version (one-line error for a version not read)."""
    if version not in VLLM_ALLREDUCE:
        raise ValueError(f"no vLLM all-reduce rules for version {version!r}: {', '.join(VLLM_ALLREDUCE)}")
    return VLLM_ALLREDUCE[version]
