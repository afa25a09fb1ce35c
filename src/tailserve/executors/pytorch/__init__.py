"""The real executor: a Llama-family model in PyTorch over a paged KV cache.

Model directories are read and written in exactly Hugging Face's format (``config.json``,
``*.safetensors``, ``tokenizer.json``): ``loader.py`` reads them, ``tokenizer.py`` wraps the
``tokenizers`` library the way ``transformers`` does, and ``init_model.py`` writes randomly
initialised models with a locally trained tokenizer, so nothing is ever downloaded.
"""

from tailserve.executors.pytorch import cpu_isa
from tailserve.executors.pytorch.threads import set_openmp_wait_policy

# Before any module here imports torch: GNU OpenMP reads its wait policy when torch loads it
# (threads.py says why a waiting thread should sleep rather than spin on a shared machine).
OPENMP_WAIT = set_openmp_wait_policy()
# Likewise a forced lower level (TAILSERVE_CPU_ISA) lowers torch's own dispatch, which it reads
# once: the CLI applies it at start-up; this covers a benchmark or script importing the executor
# first (without it a forced-AVX2 run kept ATen's AVX-512 SiLU beside tailserve's AVX2 kernels).
cpu_isa.apply_forced_level()
