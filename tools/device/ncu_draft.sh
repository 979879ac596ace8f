#!/usr/bin/env bash
# One DSpark draft's kernels under ncu (the bench's synthetic drafter, `--dspark-round`): the
# bench times its drafts as usual, then runs one more inside the profiler's capture
# (DSV4_PROFILE_DRAFT); ncu times each of its kernels alone. The kernel total against the
# draft's wall time (the bench's `dspark batch` line) is the share of launches and waits.
#   run(command: "bash tools/device/ncu_draft.sh [LAYERS] [BATCH]", carry: ["devbin.tar.xz"] after run_test.sh's unpack)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
L=${1:-4} BS=${2:-1}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
DSV4_PROFILE_DRAFT=1 timeout 400 "$NCU" --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --print-units base \
    .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$L" --weights q2 --contexts '' \
    --reserve "${BS}x4096" --decode-fill clone --decode-batches "$BS" --decode-context 4096 --decode-tokens 4 \
    --dspark-round > /tmp/ncu-draft.csv 2> /tmp/ncu-draft.err
echo "ncu: exit $?"
grep -E '^dspark batch' /tmp/ncu-draft.csv | head -2 | cut -c1-200
python3 tools/ncu_step.py --all /tmp/ncu-draft.csv > "$OUT/ncu-draft-$BS.txt"
sed -n '/^one step/,$p' "$OUT/ncu-draft-$BS.txt" | head -40
