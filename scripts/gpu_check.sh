#!/usr/bin/env bash
# GPU check for fastdit, in eight timed parts (each under its own time cap, so one slow part cannot
# eat the run):
#
#   offline  first: the offline compile check for this GPU's own capability (the kernel configs run
#            without autotuning, bf16 / fp16, head dims 64 / 128, fresh compiles with this machine's
#            Triton and shared memory): registers, spills, shared memory. Any failure ABORTS the run
#            at once (exit 3), so a lent GPU's minutes are not spent on a kernel that cannot compile
#            or spills (python -m fastdit.kernels.offline --targets native)          (T_OFFLINE=30 s)
#   kernel   correctness pass (Triton vs the float64 reference and the torch fallback), then the
#            kernel benchmark: dense SDPA (flash, cuDNN) vs fastdit's Triton kernel vs FlexAttention
#            on synthetic plans; Wan 480p and HunyuanVideo 720p sliding tile; the block-size / key-validity
#            A/B of sta's Wan plan (ab_sta_*)                                     (cap T_KERNEL=160 s)
#   patched  the patched path: fastdit.attention / run_plan with sta's and radial's own plans (text
#            tokens and key mask included) next to the kernel alone and dense SDPA   (T_PATCHED=40 s)
#   varlen   variable-size blocks (offsets; svg2's clusters): a small case against the float64
#            reference, then fixed vs variable blocks at equal density (bench.varlen)  (T_VARLEN=30 s)
#   methods  every method on structured video-like q/k/v per head kind at Wan 480p's 32760 tokens:
#            density, error against dense, selection / attention / outside-attention time, the
#            corrections, the same-density claims (bench.attention --methods)       (T_METHODS=40 s)
#   wan      one transformer forward, Wan2.1-T2V-1.3B at 480p x 81 frames, dense / sta / radial,
#            eager and torch.compile'd (bf16, random weights)                        (T_WAN=130 s)
#   hunyuan  the same for HunyuanVideo 13B at 720p x 129 frames (HY_FRAMES)           (T_HY=105 s)
#            (a dense forward is ~12 PFLOP: the eager rows fit the cap, the compiled ones, three
#            whole-model compiles of 60 blocks, do not and are skipped by the budget; run them
#            with: GPU_CHECK_PARTS=hunyuan T_HY=580 TRANSFORMER_ARGS="--modes compiled" bash ...)
#   backward (opt-in: GPU_CHECK_PARTS=backward) forward + backward of the engine (Triton) against
#            dense SDPA's at 8k and 32k tokens, density 1/8, with the ideal 1 / density and peak
#            memory (python scripts/bench_backward.py; BACKWARD_ARGS=--lora adds a tiny LoRA
#            step, which needs diffusers and peft)                                   (T_BACKWARD=90 s)
#   quant    (opt-in: GPU_CHECK_PARTS=quant) the quant modes: None / int8 / int8-fp8 (sm_89+) on the
#            engine at N=32768 and sta at Wan 480p's grid, against dense SDPA (and sageattention when
#            installed), bf16, then the accuracy table on structured inputs
#            (python scripts/bench_quant.py --speed; then without --speed)               (T_QUANT=90 s)
#   tma      (opt-in: GPU_CHECK_PARTS=tma) the two forward variants of the engine (issue 44): the
#            classic cp.async kernel (autotuned, and its untuned default) and the Hopper / Blackwell
#            TMA variant (FASTDIT_TRITON_VARIANT=tma) against dense SDPA (the default backend; flash and
#            flash_attn beside it), densities 0.1-0.5, N 32768 and 75600, head dims 64 / 128, bf16, each row
#            beside the cost model's prediction, then the measured efficiencies the cost model
#            should take for this GPU (python scripts/bench_tma.py; TMA_ARGS)           (T_TMA=300 s)
#   predict  last: every measured time of the parts above beside the cost model's prediction for this
#            GPU (python -m fastdit.eval.predict --compare; fastdit/costmodel.py)   (T_PREDICT=15 s)
#
#   bash scripts/gpu_check.sh
#   GPU_CHECK_PARTS=hunyuan T_HY=580 bash scripts/gpu_check.sh   # one part, with more time
#
# The kernel and patched parts need only torch + triton + this tree. The transformer parts need
# diffusers, which the device image lacks: wheels in .whl/ (gitignored; carry it) are installed with
# pip --no-index --no-deps into a temporary folder when diffusers is not importable, and the two
# parts are skipped with a message when it still is not. Fetch the wheel once, on a machine with
# network access:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1
# (the image's huggingface_hub, safetensors, numpy, regex, requests, Pillow and filelock satisfy
# its requirements; Python >= 3.8 needs no importlib_metadata). With the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# Output: every part's JSON plus one log (everything printed) in $OUT when set, else
# ./bench_results: offline_<stamp>.json, attention_kernel_<stamp>.json, attention_patched_<stamp>.json,
# varlen_<stamp>.json, attention_methods_<stamp>.json, transformer_wan_<stamp>.json,
# transformer_hunyuan_<stamp>.json, gpu_check_<stamp>.log (8 files, the device tool's limit).
# Caps add up to 550 s plus set-up (50 s on the first H200 run, 2026-12-04: the editable install and the
# diffusers wheel): under 10 minutes, with room for the 10 s after a cap; a part
# that reaches its cap is interrupted (SIGINT, then killed 10 s later) and keeps the rows it wrote. Transformer parts get
# --budget-s (cap - 20 s): measurements that would not fit are skipped, with the reason, in the JSON.
# Exit status: 0 when every part that ran passed, else the first failing part's status (1: a
# correctness failure; 124: a part hit its cap). Skipped parts do not fail the run.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$REPO/bench_results}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
STAMP="$(date +%Y%m%d-%H%M%S)"
LOG="$OUT_DIR/gpu_check_$STAMP.log"
PARTS="${GPU_CHECK_PARTS:-offline,kernel,patched,varlen,methods,wan,hunyuan,predict}"
T_OFFLINE="${T_OFFLINE:-30}"
T_PREDICT="${T_PREDICT:-15}"
T_KERNEL="${T_KERNEL:-160}"
T_PATCHED="${T_PATCHED:-40}"
T_VARLEN="${T_VARLEN:-30}"
T_BACKWARD="${T_BACKWARD:-90}"
T_QUANT="${T_QUANT:-90}"
T_TMA="${T_TMA:-300}"
TMA_ARGS="${TMA_ARGS:-}"
BACKWARD_ARGS="${BACKWARD_ARGS:-}"
T_METHODS="${T_METHODS:-40}"
T_WAN="${T_WAN:-130}"
T_HY="${T_HY:-105}"
HY_FRAMES="${HY_FRAMES:-129}"
# extra arguments (word-split), e.g. a CPU dry run of the script's logic:
#   GPU_CHECK_PARTS=patched,wan ATTENTION_ARGS=--quick TRANSFORMER_ARGS="--scale tiny" bash scripts/gpu_check.sh
ATTENTION_ARGS="${ATTENTION_ARGS:-}"
METHODS_ARGS="${METHODS_ARGS:---dtype bfloat16 --runs 3}"
VARLEN_ARGS="${VARLEN_ARGS:---blocks 64,128 --runs 10}"
TRANSFORMER_ARGS="${TRANSFORMER_ARGS:-}"
unset TRITON_INTERPRET            # real GPU kernels, never the CPU interpreter
export PYTHONUNBUFFERED=1
exec > >(tee -a "$LOG") 2>&1
T0=$SECONDS

# -- set-up: fastdit importable (editable install, else a sys.path shim), diffusers from wheels ------
importable() {  # can python, started in directory $1, import the engine and the benchmarks?
    (cd "$1" && "$PY" -c "import fastdit.kernels, fastdit.eval.bench.attention, fastdit.eval.bench.transformer") \
        >/dev/null 2>&1
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
        (cd "$SHIM" && "$PY" -c "import fastdit.kernels, fastdit.eval.bench.attention, fastdit.eval.bench.transformer")
        echo "[gpu_check] cannot import fastdit"; exit 2
    fi
fi

diffusers_version() { (cd "$RUN_DIR" && "$PY" -c "import diffusers; print(diffusers.__version__)" 2>/dev/null); }
HAVE_DIFFUSERS=0
DIFFUSERS_V="$(diffusers_version)"
if [ -z "$DIFFUSERS_V" ] && ls "$REPO"/.whl/diffusers-*.whl >/dev/null 2>&1; then
    SITE="$(mktemp -d)"
    echo "[gpu_check] installing $(cd "$REPO/.whl" && ls ./*.whl | tr '\n' ' ')into $SITE (no index, no deps)"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$REPO"/.whl/*.whl; then
        export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
        DIFFUSERS_V="$(diffusers_version)"
        [ -n "$DIFFUSERS_V" ] || (cd "$RUN_DIR" && "$PY" -c "import diffusers")  # show why
    fi
fi
if [ -n "$DIFFUSERS_V" ]; then
    HAVE_DIFFUSERS=1
    echo "[gpu_check] diffusers $DIFFUSERS_V"
else
    echo "[gpu_check] diffusers is not importable and no usable .whl/diffusers-*.whl was carried: the transformer"
    echo "[gpu_check] parts (wan, hunyuan) will be SKIPPED. Carry the wheel (see the top of this script)."
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
echo "[gpu_check] set-up took $((SECONDS - T0))s; parts: $PARTS"

# -- the parts ---------------------------------------------------------------------------------------
STATUS=0
SUMMARY=()
want() { [[ ",$PARTS," == *",$1,"* ]]; }
part() {  # part NAME CAP_SECONDS COMMAND... : run under the cap, record status and time
    local name="$1" cap="$2"; shift 2
    local start=$SECONDS rc
    echo ""
    echo "[gpu_check] ===== $name (cap ${cap}s) ====="
    timeout --signal=INT --kill-after=10 "$cap" "$@"
    rc=$?
    local took=$((SECONDS - start)) state="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        state="hit the ${cap}s cap (rows written so far are kept)"; rc=124
    elif [ "$rc" -eq 130 ]; then
        state="interrupted at the cap (rows written so far are kept)"; rc=124
    elif [ "$rc" -ne 0 ]; then
        state="FAILED (exit $rc)"
    fi
    SUMMARY+=("$(printf '%-8s %-60s %4ss' "$name" "$state" "$took")")
    if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi
}
skip() { SUMMARY+=("$(printf '%-8s %-60s %4s' "$1" "SKIPPED: $2" "-")"); }

if want offline; then
    part offline "$T_OFFLINE" "$PY" -m fastdit.kernels.offline --targets native --configs default --fresh used \
        --dtypes bf16,fp16 --jobs "$(nproc 2>/dev/null || echo 4)" --json "$OUT_DIR/offline_$STAMP.json"
    if [ "$STATUS" -ne 0 ]; then
        echo "[gpu_check] ABORT: the offline compile check failed on this GPU's own target (a kernel does not"
        echo "[gpu_check] compile, spills, or exceeds shared memory; see the FAIL lines above). Nothing else is"
        echo "[gpu_check] run, so the lease is not spent on kernels that cannot run well. Fix the kernel or the"
        echo "[gpu_check] config table (python -m fastdit.kernels.offline --update) first."
        exit 3
    fi
fi
if want kernel; then
    part kernel "$T_KERNEL" "$PY" -m fastdit.eval.bench.attention --check --path kernel \
        --out "$OUT_DIR/attention_kernel_$STAMP.json" $ATTENTION_ARGS
fi
if want patched; then
    part patched "$T_PATCHED" "$PY" -m fastdit.eval.bench.attention --no-check --path patched \
        --out "$OUT_DIR/attention_patched_$STAMP.json" $ATTENTION_ARGS
fi
if want varlen; then
    part varlen "$T_VARLEN" "$PY" -m fastdit.eval.bench.varlen --check --out "$OUT_DIR/varlen_$STAMP.json" \
        $VARLEN_ARGS
fi
if want backward; then
    part backward "$T_BACKWARD" "$PY" "$REPO/scripts/bench_backward.py" --device cuda --tokens 8192 32768 --runs 5 \
        --json "$OUT_DIR/backward_$STAMP.json" $BACKWARD_ARGS
fi
if want quant; then
    part quant "$T_QUANT" bash -c "\"$PY\" \"$REPO/scripts/bench_quant.py\" --speed --json \"$OUT_DIR/quant_speed_$STAMP.json\" \
        && \"$PY\" \"$REPO/scripts/bench_quant.py\" --json \"$OUT_DIR/quant_accuracy_$STAMP.json\""
fi
if want tma; then
    part tma "$T_TMA" "$PY" "$REPO/scripts/bench_tma.py" --json "$OUT_DIR/tma_$STAMP.json" $TMA_ARGS
fi
if want methods; then
    part methods "$T_METHODS" "$PY" -m fastdit.eval.bench.attention --path methods \
        --methods sta,radial,sparge,svg,todo,tome,prune,window --corrections pooled,cached \
        --json "$OUT_DIR/attention_methods_$STAMP.json" $METHODS_ARGS
fi
if want wan; then
    if [ "$HAVE_DIFFUSERS" = 1 ]; then
        part wan "$T_WAN" "$PY" -m fastdit.eval.bench.transformer --models wan --scale full \
            --budget-s $((T_WAN - 20)) --out "$OUT_DIR/transformer_wan_$STAMP.json" $TRANSFORMER_ARGS
    else
        skip wan "diffusers not available (carry .whl/diffusers-*.whl)"
    fi
fi
if want hunyuan; then
    if [ "$HAVE_DIFFUSERS" = 1 ]; then
        part hunyuan "$T_HY" "$PY" -m fastdit.eval.bench.transformer --models hunyuan --scale full \
            --hy-frames "$HY_FRAMES" --budget-s $((T_HY - 20)) --out "$OUT_DIR/transformer_hunyuan_$STAMP.json" \
            $TRANSFORMER_ARGS
    else
        skip hunyuan "diffusers not available (carry .whl/diffusers-*.whl)"
    fi
fi

if want predict; then
    MEASURED=()
    for f in "$OUT_DIR"/attention_kernel_"$STAMP".json "$OUT_DIR"/transformer_wan_"$STAMP".json \
             "$OUT_DIR"/transformer_hunyuan_"$STAMP".json; do
        [ -f "$f" ] && MEASURED+=("$f")
    done
    if [ "${#MEASURED[@]}" -gt 0 ]; then
        part predict "$T_PREDICT" "$PY" -m fastdit.eval.predict --compare "${MEASURED[@]}"
    else
        skip predict "no measurement to compare with"
    fi
fi

echo ""
echo "[gpu_check] ===== summary ($((SECONDS - T0))s in all) ====="
for line in "${SUMMARY[@]+"${SUMMARY[@]}"}"; do echo "  $line"; done
echo "[gpu_check] exit $STATUS; results in $OUT_DIR"
ls -l "$OUT_DIR" | tail -n 8
exit "$STATUS"
