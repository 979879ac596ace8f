#!/usr/bin/env bash
# Prepared in the thirty-third session (any GPU): the first GPU run of the rewritten DSpark
# block_attention (PERF.md v42: key addresses in shared memory, a warp per four keys, a
# block-wide softmax, float4 output columns with eight keys in flight; was ~185 us a stage) and of
# gemvx2p / gemvx4p (int8 products of 2 to 4 rows at two outputs a warp, DSV4_ROW_PAIRS, on by
# default) and of moe_up1sn / moe_down1sn (the experts of 2-4 rows in two launches,
# DSV4_FFN1_ROWS=4). Value checks first (block attention against its CPU twin on the drafter's
# shape, the int8 products bitwise their twin with pairs on and off, the two-launch experts of
# 1, 2 and 4 rows bitwise the separate launches, cuda_dspark, invariance, graphs),
# then the kernel table's int8 rows with pairs off and on, then one draft's kernels under ncu.
#   after build.sh and packing devbin.tar.xz: run(command: "bash tools/device/call_s34a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_backend cuda_block_attention_matches_the_cpu_twin --nocapture
grep -E '^block_attention' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_packed
run_test cuda_dspark
run_test cuda_invariance
run_test cuda_graph
for p in 0 1; do
  DSV4_ROW_PAIRS=$p timeout 200 .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/kernels-pairs$p.txt" 2>&1
  echo "== kernel table, DSV4_ROW_PAIRS=$p: exit $?" >> "$S"
  grep -E '^int8 ' "$OUT/kernels-pairs$p.txt" | cut -c1-150 >> "$S"
done
echo "== one draft's kernels (ncu, batch 1)" >> "$S"
timeout 200 bash tools/device/ncu_draft.sh 4 1 >> "$S" 2>&1
cat "$S"
