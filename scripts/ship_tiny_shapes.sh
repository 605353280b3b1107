#!/usr/bin/env bash
# Ship a retrained tiny-shapes pipeline: everything that lives beside its weights is re-made for the new weights.
#
#   scripts/ship_tiny_shapes.sh NEW_PIPELINE_FOLDER RUN_FOLDER [--dry-run]
#
# 1. copies the new pipeline's components (transformer, text encoder, VAE with its latent statistics, tokenizer,
#    scheduler, model_index.json) over pipelines/weights/tiny-shapes/ (presets.json, calibrations/, the model card,
#    the loss curve and the calibration captions stay: sta's and window's presets are measured, not calibrated);
# 2. re-makes every calibration presets.json names (`fastdit calibrate --method M --budget 0.05 --max-prompts 2`,
#    the shipped recipe: the first two training captions, 12 steps, one bucket) into RUN_FOLDER, then copies them
#    beside the weights;
# 3. measures dense adherence on the 32 held-out captions x seeds 0 and 1 at 128 x 128 (two shards, then --merge);
# 4. runs the README column (`fastdit compare`, every method) and `fastdit compare --methods dense,auto` alone on
#    the machine, two threads (their contact sheets and report.json land in RUN_FOLDER).
#
# Two processes at a time, one torch thread each; about 2 h on an idle 2-core CPU (sparge and svg2 ~20 min each,
# auto ~48 min, adherence ~70 s a video, the column ~6-8 min). Every step logs to RUN_FOLDER/*.log and a finished
# step is skipped when the script runs again. `git diff pipelines/weights/tiny-shapes` shows what changed; the
# model card, README column and BENCHMARKS.md are then written by hand from RUN_FOLDER.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 2 ]; then sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
NEW="$(cd "$1" && pwd)"; RUN="$2"; DRY="${3:-}"
W="$REPO/pipelines/weights/tiny-shapes"
COLUMN=dense,sta,sparge,svg,svg2,sla,vsa,radial,window,prune,todo,tome,optiprune
COMPONENTS="transformer text_encoder vae tokenizer scheduler model_index.json"
for c in $COMPONENTS; do
    [ -e "$NEW/$c" ] || { echo "$NEW has no $c: pass a pipeline folder written by train_tiny (its --out)" >&2; exit 2; }
done
mkdir -p "$RUN"; RUN="$(cd "$RUN" && pwd)"; cd "$REPO"
export OMP_NUM_THREADS=1

run() {  # run NAME COMMAND...: once, logged to RUN/NAME.log; RUN/NAME.done marks it finished
    local name=$1; shift
    if [ -n "$DRY" ]; then echo "$name: $*"; return; fi
    [ -f "$RUN/$name.done" ] && { echo "$name: done before, skipped"; return; }
    echo "$(date -u +%H:%M:%S) $name: $*"
    "$@" > "$RUN/$name.log" 2>&1 && touch "$RUN/$name.done"
}

if [ -z "$DRY" ]; then
    for c in $COMPONENTS; do rm -rf "${W:?}/$c"; cp -r "$NEW/$c" "$W/$c"; done
fi
# method -> the calibration file presets.json names for it, as fastdit itself reads presets.json
PAIRS=$(python -c "from fastdit.pipelines.loading import trained_presets
for method, options in trained_presets('tiny-shapes').items():
    if 'calibration' in options: print(method, options['calibration'])")
declare -A CALIBRATION
while read -r m path; do CALIBRATION[$m]=$path; done <<< "$PAIRS"
calibrate() { run "calibrate_$1" fastdit calibrate --model tiny-shapes --method "$1" --budget 0.05 --max-prompts 2 \
    --no-progress --out "$RUN/$1.json"; }
adherence() { run "adherence_$1" python scripts/shapes_adherence.py --model tiny-shapes --seeds 0,1 --shard "$1/2" \
    --threads 1 --out "$RUN/adherence"; }

# the slow auto calibration beside the others and the first adherence shard; a failure stops the script
pids=()
for m in "${!CALIBRATION[@]}"; do [ "$m" = auto ] || { calibrate "$m" & pids+=($!); }; done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
if [ -n "${CALIBRATION[auto]:-}" ]; then calibrate auto & pids=($!); fi
adherence 0
for p in "${pids[@]}"; do wait "$p"; done
adherence 1
run adherence_merge python scripts/shapes_adherence.py --seeds 0,1 --merge --out "$RUN/adherence"
if [ -z "$DRY" ]; then
    for m in "${!CALIBRATION[@]}"; do cp "$RUN/$m.json" "${CALIBRATION[$m]}"; done
fi
export OMP_NUM_THREADS=2
run column fastdit compare --methods "$COLUMN" --out "$RUN/column"
run auto_column fastdit compare --methods dense,auto --out "$RUN/auto_column"
echo "shipped into $W; the numbers: $RUN/adherence, $RUN/column/report.json, $RUN/auto_column/report.json"
