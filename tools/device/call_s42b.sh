#!/usr/bin/env bash
# Forty-second session, any GPU, ~3 minutes: where the lightning indexer's decode launch
# (index_score_topk, 23.5 µs a CSA layer in call_s42a's ncu table, the largest latency-bound
# kernel left) spends its time. On aaeae85's binaries with v50's defaults by environment (att16 +
# kvar/atmw). (1) One 4-layer step's per-node table with the scores and the top-k as two
# launches (DSV4_INDEX_FUSED=0): index_score against index_topk. (2) ncu's full set on those two
# and the router (gemv_route): executed instructions a warp, cycles an issue, occupancy.
# (3) Batch 1 with DSV4_INDEX_FUSED=0 against the built-in.
#   run(command: "bash tools/device/call_s42b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 400
export DSV4_ATT_TC_HEADS=16 DSV4_CUDA_KERNELS=.devbin/kvar/atmw
t && { DSV4_INDEX_FUSED=0 CTX=4096 TAG=-split bash tools/device/profile.sh 4 q2 1 > "$OUT/profile.txt" 2>&1;
       grep -E '^ *[0-9.]+ +(index|gemv_route|gemvt|norm_many)|^one step' "$OUT/ncu-q2-1-split.txt" | head -20 >> "$S"; }
t && { DSV4_INDEX_FUSED=0 bash tools/device/ncu_step_kernels.sh 'index_score|index_topk|gemv_route' 4 6 > "$OUT/nsk.txt" 2>&1;
       cat "$OUT/nsk.txt" >> "$S"
       grep -E '^  [a-z_0-9]+\(|Executed Instructions  |Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Issued Ipc|No Eligible' \
         "$OUT/ncu-step-kernels.txt" | head -90 >> "$S"; }
for v in base split base split; do
  # shellcheck disable=SC2046
  t && { e=; [ $v = split ] && e=DSV4_INDEX_FUSED=0; step1 $v-$(date +%s) $e; }
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
