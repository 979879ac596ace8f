#!/usr/bin/env bash
# ncu's full section set on the kernels of one decode step that match REGEX (graph nodes one by
# one, warm caches, real clocks) into the report REPORT.ncu-rep; ncu_stalls.sh and
# ncu_source.sh read it their own ways. More ncu flags may follow.
#   bash tools/device/ncu_full.sh REGEX LAYERS COUNT REPORT [NCU-FLAG...]
# CTX (4096), BATCH (1) and EXTRA as profile.sh's.
set -uo pipefail
cd "$(dirname "$0")/../.."
RE=$1 L=$2 C=$3 R=$4
shift 4
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
DSV4_PROFILE_CAPTURE=1 timeout 300 "$NCU" --profile-from-start off --graph-profiling node --set full "$@" \
    --clock-control none --cache-control none -k "regex:$RE" -c "$C" -f -o "$R" \
    .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$L" --weights q2 --contexts '' \
    --decode-batches "${BATCH:-1}" --decode-context "${CTX:-4096}" --decode-tokens 1 ${EXTRA:-} > "$R.out" 2> "$R.err"
echo "ncu: exit $?"
tail -3 "$R.err"
