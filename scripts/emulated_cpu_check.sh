#!/usr/bin/env bash
# The real executor on an emulated CPU, against transformers (scripts/emulated_cpu_check.py).
#
#   scripts/emulated_cpu_check.sh [x86-haswell|x86-native|aarch64] [extra args for the .py]
#
#   x86-haswell  (default) this python under `qemu-x86_64 -cpu Haswell` (Debian's qemu-user):
#                an x86-64 CPU with AVX2 and FMA and no AVX-512, whatever the host has. CPUID
#                (which torch and tailserve read) is the emulated CPU's; /proc/cpuinfo stays the
#                host's. QEMU_CPU_MODEL picks another model (Nehalem: no AVX, level generic).
#                qemu 7.2's TCG cannot emulate AVX-512 at all (-cpu Skylake-Server / max report
#                none), so the avx512 levels cannot be checked this way. Subprocesses (g++ and
#                ninja building the fused kernels) run natively, which is why the kernels are
#                compiled with an explicit -march for the detected level.
#   x86-native   the same check without an emulator (a baseline for the time and tokens).
#   aarch64      an arm64 Debian python with PyPI's aarch64 torch, under `qemu-aarch64 -L ROOT`;
#                ROOT ($EMULATED_CPU_ROOT, default /tmp/tailserve-arm64-root, ~1.4 GB) is built
#                on first use by scripts/emulated_cpu_arm64_root.sh (needs root; 308 s measured).
#                The fused kernels are built with Debian's aarch64-linux-gnu-g++ (a host
#                program: qemu-user runs subprocesses natively).
#
# Environment: EMULATED_CPU_OUT (default /tmp/emulated_cpu_check-<target>.json): the JSON result;
# PYTHON (x86 targets; default python3). Each run writes its tiny model and compiles the kernels
# afresh in a temporary TAILSERVE_CACHE. Measured on the 2-core EPYC (Zen 3): ~1.5-2 min for
# x86-haswell, ~1 min for aarch64 and x86-native (docs/executor.md, "Checked on an emulated
# CPU"). Not part of the test suite. Exit status: the .py's (0: float32 tokens equal
# transformers' and every dtype ran), 2 for a usage or set-up problem.
set -euo pipefail

target="${1:-x86-haswell}"
[ $# -gt 0 ] && shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="${EMULATED_CPU_OUT:-/tmp/emulated_cpu_check-$target.json}"
python="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"

need_apt() {  # need_apt BINARY PACKAGE...
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "emulated_cpu_check: $1 not found; installing Debian's ${*:2} with apt-get" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "emulated_cpu_check: no apt-get here: install ${*:2} (qemu-user) yourself" >&2
        exit 2
    fi
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${@:2}" >/dev/null
}

start=$(date +%s)
case "$target" in
x86-haswell)
    [ "$(uname -m)" = x86_64 ] || { echo "x86-haswell needs an x86-64 host" >&2; exit 2; }
    need_apt qemu-x86_64 qemu-user
    cpu="${QEMU_CPU_MODEL:-Haswell}"
    echo "emulated_cpu_check: $(qemu-x86_64 --version | head -1), -cpu $cpu, python $python" >&2
    # qemu warns about each Haswell feature TCG lacks (pcid, x2apic, hle, rtm, ...): harmless.
    set +e
    EMULATED_CPU_CHECK_EMULATOR="qemu-x86_64 -cpu $cpu" \
        qemu-x86_64 -cpu "$cpu" "$python" "$here/emulated_cpu_check.py" --out "$out" "$@" \
        2> >(grep -v "TCG doesn't support requested feature" >&2)
    rc=$?
    set -e
    ;;
x86-native)
    set +e
    "$python" "$here/emulated_cpu_check.py" --out "$out" "$@"
    rc=$?
    set -e
    ;;
aarch64)
    root="${EMULATED_CPU_ROOT:-/tmp/tailserve-arm64-root}"
    need_apt qemu-aarch64 qemu-user
    if [ ! -x "$root/venv/bin/python" ] || [ ! -d "$root/venv/lib/python3.11/site-packages/torch" ]; then
        "$here/emulated_cpu_arm64_root.sh" "$root"
    fi
    echo "emulated_cpu_check: $(qemu-aarch64 --version | head -1), arm64 root $root" >&2
    # -L: the arm64 root's /lib and /usr come first. The repo's src/ is read in place (host
    # path, pure Python). Subprocesses run as host programs: CXX is the cross compiler, PATH
    # leaves out the venv (its pip ninja is an arm64 binary the host cannot execute), and
    # cross-include/ holds only the root's multiarch pyconfig.h directory (Debian's Python.h
    # includes <aarch64-linux-gnu/python3.11/pyconfig.h>, which the cross compiler's own
    # include path lacks).
    set +e
    env -u PYTHONHOME EMULATED_CPU_CHECK_EMULATOR="qemu-aarch64 -L $root" PYTHONPATH="$repo/src" \
        CXX="${CXX_AARCH64:-aarch64-linux-gnu-g++}" CPLUS_INCLUDE_PATH="$root/cross-include" \
        PATH=/usr/local/bin:/usr/bin:/bin \
        qemu-aarch64 -L "$root" "$root/venv/bin/python" "$here/emulated_cpu_check.py" --out "$out" "$@"
    rc=$?
    set -e
    ;;
*)
    echo "usage: $0 [x86-haswell|x86-native|aarch64] [args for emulated_cpu_check.py]" >&2
    exit 2
    ;;
esac
end=$(date +%s)
echo "emulated_cpu_check: $target finished with status $rc in $((end - start)) s; result in $out" >&2
exit "$rc"
