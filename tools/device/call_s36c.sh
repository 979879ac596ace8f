#!/usr/bin/env bash
# Prepared in the thirty-sixth session (PERF.md v45), any GPU, ~10 minutes: the side branch
# (a layer's compressors on a second stream) checked bitwise and measured, the thirty-fifth
# session's kernels checked, then the experts table while the call has time.
#   run(command: "bash tools/device/call_s36c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
FL=43; case "$G" in *H100*) FL=32 ;; esac
T0=$(date +%s)
export DSV4_BIN=.devbin/dsv4
run_test cuda_gguf cuda_gguf_side_branch_is_bitwise --nocapture
grep -E '^exact' "$OUT/test-cuda_gguf.txt" >> "$S"
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
batch1_rounds $FL side0
batch1_rounds $FL side1 DSV4_SIDE=1
batches_16_64 $FL; mv "$OUT/b1664.txt" "$OUT/b1664-side0.txt"
export DSV4_SIDE=1; batches_16_64 $FL; unset DSV4_SIDE
run_test cuda_backend
experts_variants $T0 base up4b xa pf512 dn5bp sel16
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
