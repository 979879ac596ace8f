#!/usr/bin/env bash
# One decode step's kernels under ncu (see tools/ncu_step.py), graph nodes profiled one by one:
#   run(command: "bash tools/device/profile.sh [LAYERS] [WEIGHTS] [BATCH]", carry: [".devbin"])
# Extra environment (DSV4_INT8=1, say) passes through to the bench; EXTRA adds bench arguments
# ("--reserve 64x4096 --decode-fill clone": batch 64 from one prefilled sequence). PREFILL=N profiles one
# N-token prefill chunk instead (its plain forward is captured after the decode step, so the
# report's last forward is the chunk).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
L=${1:-4} W=${2:-q2} BS=${3:-1} TAG=${TAG:-}
# CTX: the decode context (default 16). Only one extra decode step is captured
# (DSV4_PROFILE_CAPTURE), so the weight draw and the prefill to CTX run at full speed.
CTX=${CTX:-16}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
PF=()
[ -n "${PREFILL:-}" ] && PF=(env DSV4_PROFILE_PREFILL="$PREFILL")
"${PF[@]}" env DSV4_PROFILE_CAPTURE=1 timeout 250 "$NCU" --profile-from-start off --graph-profiling node --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --print-units base \
    .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$L" --weights "$W" --contexts '' \
    --decode-batches "$BS" --decode-context "$CTX" --decode-tokens 1 ${EXTRA:-} > /tmp/ncu.csv 2> /tmp/ncu.err
echo "ncu: exit $?"
tail -3 /tmp/ncu.err
python3 tools/ncu_step.py /tmp/ncu.csv "$L" > "$OUT/ncu-$W-$BS$TAG.txt"
sed -n '/^one step/,$p' "$OUT/ncu-$W-$BS$TAG.txt" | head -40
