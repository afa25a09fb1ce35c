#!/usr/bin/env bash
# An arm64 Python for scripts/emulated_cpu_check.sh aarch64, from registry packages only:
#
#   scripts/emulated_cpu_arm64_root.sh [ROOT]      (default /tmp/tailserve-arm64-root; needs root)
#
# 1. debootstrap --foreign downloads Debian bookworm's arm64 python3 (3.11) and its libraries;
#    every .deb is unpacked with dpkg-deb -x. The second stage (maintainer scripts) is never
#    run: it would need arm64 binaries to run as subprocesses, i.e. a binfmt_misc handler on the
#    host kernel, which this script does not register (a host-wide change; in a container
#    /proc/sys/fs/binfmt_misc is usually not even mounted). Unpacked files are all Python needs.
# 2. A venv made by that python under `qemu-aarch64 -L ROOT` (the -L prefix maps /lib, /usr
#    to the root's arm64 files), pip bootstrapped from the pip wheel, then pip (emulated, so it
#    resolves markers for aarch64) installs torch and the executor's dependencies from PyPI.
#
# torch: TORCH_VERSION (default 2.10.0), the newest CPU-only aarch64 wheel on PyPI. From 2.11.0
# on, PyPI's manylinux_2_28_aarch64 torch is a CUDA 13 build: `import torch` fails without
# ~GBs of nvidia-* / cuda-toolkit wheels (libcudart.so.13 / libcublasLt not found).
#
# Also installs Debian's g++-aarch64-linux-gnu on the host: under qemu-user the executor's
# subprocesses (the compiler, ninja) are host programs, so the fused kernels are built with the
# cross compiler (CXX=aarch64-linux-gnu-g++ in emulated_cpu_check.sh) into an aarch64 .so that
# the emulated process loads.
set -euo pipefail

root="${1:-${EMULATED_CPU_ROOT:-/tmp/tailserve-arm64-root}}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
torch_version="${TORCH_VERSION:-2.10.0}"
# The host's versions where the check compares against transformers (same tokenizer/loader code).
host_pin() { python3 -c "import importlib.metadata as m; print('$1=='+m.version('$1'))" 2>/dev/null || echo "$1"; }

[ "$(id -u)" -eq 0 ] || { echo "emulated_cpu_arm64_root: needs root (debootstrap, apt-get)" >&2; exit 2; }
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v ninja >/dev/null || missing+=(ninja-build)
if [ ${#missing[@]} -gt 0 ]; then
    echo "emulated_cpu_arm64_root: installing ${missing[*]} with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

t0=$(date +%s)
mkdir -p "$root"
if [ ! -x "$root/usr/bin/python3.11" ]; then
    echo "emulated_cpu_arm64_root: debootstrap --foreign arm64 bookworm into $root" >&2
    debootstrap --arch arm64 --foreign --variant=minbase \
        --include=python3,python3-venv,libpython3.11-dev bookworm "$root" "$mirror" >/dev/null
    for deb in "$root"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$root"; done
    rm -f "$root"/var/cache/apt/archives/*.deb
fi
# For the cross compiler: only the arm64 pyconfig.h directory (the root's whole /usr/include would
# put its glibc headers ahead of the cross toolchain's).
mkdir -p "$root/cross-include/aarch64-linux-gnu"
ln -sfn "$root/usr/include/aarch64-linux-gnu/python3.11" "$root/cross-include/aarch64-linux-gnu/python3.11"
py=(qemu-aarch64 -L "$root" "$root/usr/bin/python3.11")
"${py[@]}" -c 'import platform, sys; print("arm64 python", sys.version.split()[0], platform.machine())'

if [ ! -x "$root/venv/bin/python" ]; then
    "${py[@]}" -m venv --without-pip "$root/venv"
fi
vpy=(qemu-aarch64 -L "$root" "$root/venv/bin/python")
if ! "${vpy[@]}" -m pip --version >/dev/null 2>&1; then
    mkdir -p "$root/wheels"
    python3 -m pip download -q --no-deps pip -d "$root/wheels"
    whl=$(ls "$root"/wheels/pip-*.whl | head -1)
    "${vpy[@]}" "$whl/pip" install -q --no-deps "$whl"
fi
echo "emulated_cpu_arm64_root: pip install torch==$torch_version and the executor's dependencies (emulated: minutes)" >&2
"${vpy[@]}" -m pip install -q --disable-pip-version-check "torch==$torch_version" numpy rich tqdm msgspec pyzmq setuptools \
    "$(host_pin safetensors)" "$(host_pin tokenizers)" "$(host_pin transformers)"
"${vpy[@]}" -c 'import torch; print("arm64 torch", torch.__version__, torch.backends.cpu.get_cpu_capability())'
echo "emulated_cpu_arm64_root: ready in $(( $(date +%s) - t0 )) s ($(du -sh "$root" | cut -f1) in $root)" >&2
