#!/usr/bin/env bash
# Prepared in the thirty-seventh session (PERF.md v46), any GPU, ~10 minutes: the side branches
# (a layer's compressors, the indexer's query product, the shared expert's gate/up beside the
# router) checked bitwise and measured, X8_PTAB (kvar/ptab) checked and measured against the same
# source with it off (kvar/ptab0), DSV4_INDEX_SPREAD=0 at batch 1, batches 16 and 64 with the
# side off and on, then the experts variants while the call has time.
#   run(command: "bash tools/device/call_s37a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
run_test cuda_gguf cuda_gguf_side_branch_is_bitwise --nocapture
grep -E '^exact' "$OUT/test-cuda_gguf.txt" >> "$S"
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
export DSV4_CUDA_KERNELS=.devbin/kvar/ptab; cp "$OUT/test-cuda_packed.txt" "$OUT/test-cuda_packed-base.txt"
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
unset DSV4_CUDA_KERNELS
# Each later part only while the call has time (LIMIT: seconds from the start, default 420).
t && batch1_rounds $FL side0 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && batch1_rounds $FL side1 DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && batch1_rounds $FL side1ptab DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab
t && batch1_rounds $FL side0b DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && BUDGET=$LIMIT experts_variants $T0 ptab0 ptab
t && step1 spread128 DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && step1 spread0 DSV4_SIDE=1 DSV4_INDEX_SPREAD=0 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && { batches_16_64 $FL; mv "$OUT/b1664.txt" "$OUT/b1664-side0.txt"; }
t && { export DSV4_SIDE=1; batches_16_64 $FL; unset DSV4_SIDE; }
t && BUDGET=$LIMIT experts_variants $T0 base up4b xa pf512 dn5bp sel16
t && run_test cuda_backend
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
