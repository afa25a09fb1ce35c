#!/usr/bin/env bash
# The real executor on a CUDA GPU in one short run (< 8 min): float32 tokens vs transformers,
# a W-style throughput run, the decode step's GPU time split. See scripts/gpu_check.py.
#
#   scripts/gpu_check.sh [OUT_DIR]        # results in OUT_DIR/gpu_check.json (default: .)
#
# Needs python3 with torch (CUDA build), transformers, safetensors, tokenizers and rich — the
# usual GPU image has them. Runs from the checkout (PYTHONPATH=src), installing nothing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-.}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
export TAILSERVE_CACHE="${TAILSERVE_CACHE:-$(mktemp -d)}"
start=$(date +%s)
PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" python3 "$repo/scripts/gpu_check.py" --out "$out/gpu_check.json"
echo "gpu_check: $(( $(date +%s) - start )) s"
