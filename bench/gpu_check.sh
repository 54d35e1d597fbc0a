#!/usr/bin/env bash
# The prepared GPU check (see bench/gpu_check.py): one JSON line per measurement on stdout.
#   bash bench/gpu_check.sh                      # on a CUDA machine (H200: under 5 minutes)
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh  # CPU rehearsal at a tiny shape (what CI runs)
# PYTHON selects the interpreter (default: python3, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
export TOKENIZERS_PARALLELISM=false
args=()
if [[ "${GPU_CHECK_DRY_RUN:-0}" == "1" ]]; then
  args+=(--dry-run)
  export CUDA_VISIBLE_DEVICES=""
fi
PY="${PYTHON:-$(command -v python3 || command -v python)}"
"$PY" -c "import torch, transformers" || { echo "gpu_check: $PY lacks torch/transformers (pip install -e .)" >&2; exit 2; }
exec "$PY" bench/gpu_check.py ${args[@]+"${args[@]}"}
