#!/usr/bin/env bash
# Prepared in the thirty-fifth session (PERF.md v44): the session's kernel changes against the
# kernels of 01ba452 (kvar/s34: quant.cu, hc.cu and attention.cu) at batch 1 on 43 layers (an
# H200; 32 on an H100), decode and the DSpark rounds, then cuda_invariance and batches 16 / 64.
#   run(command: "bash tools/device/call_s36b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
FL=43; case "$G" in *H100*) FL=32 ;; esac
batch1_rounds $FL builtin
batch1_rounds $FL s34 DSV4_CUDA_KERNELS=.devbin/kvar/s34
run_test cuda_invariance
batches_16_64 $FL
cat "$S"
