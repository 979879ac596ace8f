#!/usr/bin/env bash
# Prepared in the thirty-seventh session (PERF.md v46), any GPU (an H200 gives the 43-layer
# figures), ~7 minutes: the chain table (what a kernel boundary costs against a grid barrier),
# then batch 1 with the side branch on (the default) and off, alternating, then with the shared
# pair in the router's launch (DSV4_ROUTE_SHARED) on and off, batches 16 and 64, and the CUDA
# tests while the call has time (cuda_packed holds route_up1s bitwise).
#   run(command: "bash tools/device/call_s38a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
timeout 120 .devbin/dsv4 bench --backend cuda --synthetic kernels --tables chain > "$OUT/chain.txt" 2>&1
echo "chain table: exit $?" >> "$S"; grep -E '^chain|rror' "$OUT/chain.txt" | cut -c1-200 >> "$S"
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
for m in 1 0 1 0; do
  t && batch1_rounds $FL side$m-$(date +%s) DSV4_SIDE=$m
done
# The shared pair in the router's launch (DSV4_ROUTE_SHARED, new in the thirty-seventh session).
for v in 1 0 1 0; do
  t && batch1_rounds $FL rs$v-$(date +%s) DSV4_ROUTE_SHARED=$v
done
t && batches_16_64 $FL
for t in cuda_gguf cuda_graph cuda_dspark cuda_invariance cuda_packed cuda_backend; do
  t && run_test $t
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
