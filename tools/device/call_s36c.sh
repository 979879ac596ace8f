#!/usr/bin/env bash
# Prepared in the thirty-sixth session (PERF.md v45), any GPU, ~10 minutes: the side branch
# (a layer's compressors on a second stream) checked bitwise and measured, X8_PTAB (kvar/ptab:
# the expert kernels' table in shared memory) checked and measured against the same source with
# it off (kvar/ptab0), DSV4_INDEX_SPREAD=0 at batch 1, then the thirty-fifth session's variants
# while the call has time.
#   run(command: "bash tools/device/call_s36c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
run_test cuda_gguf cuda_gguf_side_branch_is_bitwise --nocapture
grep -E '^exact' "$OUT/test-cuda_gguf.txt" >> "$S"
export DSV4_CUDA_KERNELS=.devbin/kvar/ptab; run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
unset DSV4_CUDA_KERNELS
# Each later part only while the call has time (LIMIT: seconds from the start, default 420).
t && batch1_rounds $FL side0 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && batch1_rounds $FL side1 DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && batch1_rounds $FL side1ptab DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab
t && BUDGET=$LIMIT experts_variants $T0 ptab0 ptab
t && step1 spread128 DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && step1 spread0 DSV4_SIDE=1 DSV4_INDEX_SPREAD=0 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && { batches_16_64 $FL; mv "$OUT/b1664.txt" "$OUT/b1664-side0.txt"; }
t && { export DSV4_SIDE=1; batches_16_64 $FL; unset DSV4_SIDE; }
t && run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
t && BUDGET=$LIMIT experts_variants $T0 base up4b xa pf512 dn5bp sel16
t && run_test cuda_backend
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
