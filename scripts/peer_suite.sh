#!/usr/bin/env bash
# diffusers' own transformer model tests, unpatched and with every supported model patched by fastdit.
#
#   scripts/peer_suite.sh METHOD[,METHOD...] [OPTIONS_JSON]
#
# Extracts diffusers' tests/ (../shared/thirdparty/diffusers-tests-58eb52c.tar.gz) to a temporary
# folder, runs the transformer test files of the families fastdit supports once unpatched and once per
# method (tests/peer/fastdit_peer_plugin.py patches each model before its first forward with
# fastdit.patch(model, METHOD, **OPTIONS_JSON)), and prints the tests whose outcome changed.
# OPTIONS_JSON defaults to {"dense_steps": 0, "dense_layers": 0} (the method's guard default applies
# unless it sets "guard"). Exits 1 when a changed outcome is not listed, with its reason, in the
# allow-list (tests/peer/allowed_changes.txt), 2 when the tarball or a run is missing.
#
# Environment:
#   FASTDIT_PEER_TARBALL  the tarball (default: ../shared/thirdparty/ or shared/thirdparty/ beside the repo)
#   FASTDIT_PEER_FILES    space-separated test files under tests/models/transformers/ (default: the 15 below)
#   FASTDIT_PEER_ALLOW    the allow-list (default tests/peer/allowed_changes.txt)
#   FASTDIT_PEER_OUT      keep junit-xml, logs and JSON summaries here (default: a temporary folder, removed)
#   FASTDIT_PEER_BASE     an unpatched junit-xml of the same files to reuse instead of running it again
#   FASTDIT_PEER_PYTEST   extra pytest arguments (e.g. "-x" or "-k flux")
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 1 ]; then
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
METHODS="$1"
OPTIONS='{"dense_steps": 0, "dense_layers": 0}'
if [ $# -ge 2 ] && [ -n "$2" ]; then OPTIONS="$2"; fi
ALLOW="${FASTDIT_PEER_ALLOW:-$REPO/tests/peer/allowed_changes.txt}"
PY="${PYTHON:-python}"

TARBALL="${FASTDIT_PEER_TARBALL:-}"
if [ -z "$TARBALL" ]; then
    for candidate in "$REPO/../shared/thirdparty" "$REPO/shared/thirdparty"; do
        if [ -f "$candidate/diffusers-tests-58eb52c.tar.gz" ]; then TARBALL="$candidate/diffusers-tests-58eb52c.tar.gz"; break; fi
    done
fi
if [ -z "$TARBALL" ] || [ ! -f "$TARBALL" ]; then
    echo "peer_suite: diffusers-tests-58eb52c.tar.gz not found (set FASTDIT_PEER_TARBALL)" >&2
    exit 2
fi

# The families in docs/models.md that diffusers has a transformer model test file for
# (kandinsky5 has none at this commit; sana and sana_video are not patchable).
DEFAULT_FILES="test_models_transformer_wan.py test_models_transformer_wan_vace.py test_models_transformer_skyreels_v2.py
test_models_transformer_hunyuan_video.py test_models_transformer_hunyuan_1_5.py test_models_transformer_cogvideox.py
test_models_transformer_ltx.py test_models_transformer_mochi.py test_models_transformer_cosmos.py
test_models_transformer_allegro.py test_models_transformer_flux.py test_models_transformer_flux2.py
test_models_transformer_sd3.py test_models_transformer_qwenimage.py test_models_pixart_transformer2d.py"
FILES=""
for f in ${FASTDIT_PEER_FILES:-$DEFAULT_FILES}; do FILES="$FILES tests/models/transformers/$(basename "$f")"; done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/fastdit-peer.XXXXXX")"
OUT="${FASTDIT_PEER_OUT:-$WORK/out}"
mkdir -p "$OUT"
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$TARBALL" -C "$WORK" tests || { echo "peer_suite: cannot extract $TARBALL" >&2; exit 2; }

export HF_HUB_OFFLINE=1 PYTHONPATH="$REPO/tests/peer${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1

run() {  # run NAME METHOD: junit-xml in $OUT/NAME.xml, log in $OUT/NAME.log
    local name="$1" method="$2" start end
    start=$(date +%s)
    (cd "$WORK" && FASTDIT_PEER_METHOD="$method" FASTDIT_PEER_OPTIONS="$OPTIONS" FASTDIT_PEER_REPORT="$OUT/$name.models.json" \
        "$PY" -m pytest -q -p no:cacheprovider -p fastdit_peer_plugin --rootdir="$WORK" \
        --junitxml="$OUT/$name.xml" ${FASTDIT_PEER_PYTEST:-} $FILES >"$OUT/$name.log" 2>&1)
    end=$(date +%s)
    echo "$name: $(tail -n 1 "$OUT/$name.log" | sed 's/=//g' | xargs) (wall $((end - start)) s)"
    grep -A3 "^fastdit peer plugin" "$OUT/$name.log" | sed 's/^/    /' || true
    [ -s "$OUT/$name.xml" ] || { echo "peer_suite: $name wrote no junit-xml; see $OUT/$name.log" >&2; return 2; }
}

echo "peer suite: diffusers $("$PY" -c 'import diffusers; print(diffusers.__version__)'), $(echo $FILES | wc -w) files, options $OPTIONS"
if [ -n "${FASTDIT_PEER_BASE:-}" ]; then
    cp "$FASTDIT_PEER_BASE" "$OUT/unpatched.xml"
    echo "unpatched: reused $FASTDIT_PEER_BASE"
else
    run unpatched "" || exit 2
fi
status=0
for method in ${METHODS//,/ }; do
    run "$method" "$method" || exit 2
    "$PY" "$REPO/tests/peer/peer_compare.py" "$OUT/unpatched.xml" "$OUT/$method.xml" --method "$method" \
        --allow "$ALLOW" --json "$OUT/$method.json" || status=1
done
if [ -n "${FASTDIT_PEER_OUT:-}" ]; then echo "outputs: $OUT"; fi
exit $status
