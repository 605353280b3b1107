#!/usr/bin/env bash
# GPU check for fastdit's attention engine: the correctness pass, then the full benchmark
# (dense SDPA flash/cuDNN vs fastdit Triton vs FlexAttention; Wan 480p, HunyuanVideo 720p STA).
#
#   bash scripts/gpu_check.sh [extra args for python -m fastdit.eval.bench_attention]
#
# Writes attention_gpu_<stamp>.json, the printed table (.txt) and the full log into $OUT when set,
# else ./bench_results. Needs only torch + triton + this source tree (no diffusers): fastdit is
# installed editable without dependencies, or, if pip cannot do that, imported through a small
# sys.path shim. Exit status: that of the benchmark (non-zero when a correctness check fails).
# Target: well under 10 minutes on one H200 (the Python step is capped by BENCH_TIMEOUT seconds).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$REPO/bench_results}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python}"
STAMP="$(date +%Y%m%d-%H%M%S)"
LOG="$OUT_DIR/gpu_check_$STAMP.log"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-540}"
unset TRITON_INTERPRET            # real GPU kernels, never the CPU interpreter
export PYTHONUNBUFFERED=1
exec > >(tee -a "$LOG") 2>&1

importable() {  # can python, started in directory $1, import the engine and the benchmark?
    (cd "$1" && "$PY" -c "import fastdit.kernels, fastdit.eval.bench_attention") >/dev/null 2>&1
}

RUN_DIR="$REPO"
FORCE_SHIM="${FASTDIT_FORCE_SHIM:-0}"   # 1: skip pip, test the shim
if [ "$FORCE_SHIM" != 1 ] && ! importable "$REPO"; then
    echo "[gpu_check] pip install -e . --no-deps --no-build-isolation"
    "$PY" -m pip install -e "$REPO" --no-deps --no-build-isolation -q \
        || echo "[gpu_check] editable install failed; trying the sys.path shim"
fi
if [ "$FORCE_SHIM" = 1 ] || ! importable "$REPO"; then
    # fastdit.kernels / .eval / .pipelines live in top-level folders (pyproject package-dir):
    # mirror that layout with symlinks and run from the shim so ./fastdit does not shadow it.
    SHIM="$(mktemp -d)"
    mkdir "$SHIM/fastdit"
    for f in "$REPO"/fastdit/*; do ln -s "$f" "$SHIM/fastdit/"; done
    for sub in kernels eval pipelines; do ln -sfn "$REPO/$sub" "$SHIM/fastdit/$sub"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    RUN_DIR="$SHIM"
    echo "[gpu_check] using sys.path shim $SHIM"
    if ! importable "$SHIM"; then
        (cd "$SHIM" && "$PY" -c "import fastdit.kernels, fastdit.eval.bench_attention")
        echo "[gpu_check] cannot import fastdit"; exit 2
    fi
fi

cd "$RUN_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "[gpu_check] no nvidia-smi"
"$PY" - <<'PYEOF'
import torch, fastdit.kernels
print(f"[gpu_check] fastdit.kernels from {fastdit.kernels.__file__}")
try:
    import triton
    tv = triton.__version__
except Exception as e:  # the benchmark reports it too
    tv = f"unavailable ({e})"
print(f"[gpu_check] torch {torch.__version__}  triton {tv}  cuda {torch.version.cuda}  "
      f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
PYEOF

timeout --signal=INT --kill-after=20 "$BENCH_TIMEOUT" "$PY" -m fastdit.eval.bench_attention --check \
    --out "$OUT_DIR/attention_gpu_$STAMP.json" --table "$OUT_DIR/attention_gpu_$STAMP.txt" "$@"
rc=$?
if [ "$rc" -eq 124 ]; then echo "[gpu_check] benchmark hit the ${BENCH_TIMEOUT}s cap; partial JSON kept"; fi
echo "[gpu_check] exit $rc; results in $OUT_DIR"
ls -l "$OUT_DIR" | tail -n 5
exit "$rc"
