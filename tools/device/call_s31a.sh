#!/usr/bin/env bash
# Prepared in the thirtieth session for the next: where the several-row expert kernels' warps
# wait at batch 64 (PERF.md "Next (after v39)" item 2). ncu's stall table for moe_upx and
# moe_downx (one launch each of a 4-layer batch-64 step), then their per-instruction samples
# (the SASS lines holding the most stall samples, by reason).
#   after build.sh and packing: run(command: "bash tools/device/call_s31a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
export EXTRA="--reserve 64x4096 --decode-fill clone" BATCH=64
bash tools/device/ncu_stalls.sh 'moe_upx_iq2_xxs|moe_downx_q2_k' 4 2 >> "$S" 2>&1
for k in moe_upx_iq2_xxs moe_downx_q2_k; do
  TAG=-$k bash tools/device/ncu_source.sh "$k" 4 1 > /dev/null 2>&1
  echo "== $k (source counters)" >> "$S"
  head -40 "$OUT/source-64-$k.txt" >> "$S"
done
cat "$S"
