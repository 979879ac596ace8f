#!/usr/bin/env bash
# Prepared in the thirty-second session for the next (any GPU, after call_s33a.sh on the same
# binaries): the several-row expert kernels' L2 prefetch of a later block's rows (PERF.md v41,
# X8_PF_BLOCKS, off when built in) at 1024 blocks ahead (`pf1024`), gemvx's prefetch of its own
# row (X8_PF_SELF, `self`), and both (`pfself`): the experts test under pfself, decode steps at
# batches 16 and 64, then ncu's stall table under pf1024 at 64. (devbin.tar.xz here: binaries at
# fbe3f3e, whose quant.cu has X8_PF_BLOCKS but not X8_PF_SELF; the directories are fafd6f1's
# quant.cu, the same launch signatures.)
#   after build.sh: `bash tools/device/variants.sh "pf1024=sed:quant.cu:s/#define X8_PF_BLOCKS 0/#define X8_PF_BLOCKS 1024/"
#   "self=sed:quant.cu:s/#define X8_PF_SELF 0/#define X8_PF_SELF 1/"
#   "pfself=sed:quant.cu:s/#define X8_PF_BLOCKS 0/#define X8_PF_BLOCKS 1024/;s/#define X8_PF_SELF 0/#define X8_PF_SELF 1/"`, then pack devbin.tar.xz:
#   run(command: "bash tools/device/call_s33b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/pfself run_test cuda_packed cuda_packed_experts_match_cpu
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/pfself run_test cuda_packed cuda_int8_products_match_the_twin
for b in 16 64; do
  echo "== batch $b" >> "$S"
  BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh .devbin/kvar/pf1024 .devbin/kvar/self .devbin/kvar/pfself 2>&1 | cut -c1-80 >> "$S"
done
echo "== ncu batch 64, pf1024" >> "$S"
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/pf1024 EXTRA="--reserve 64x4096 --decode-fill clone" BATCH=64 timeout 120 \
    bash tools/device/ncu_stalls.sh 'moe_upx_iq2_xxs|moe_downx_q2_k' 4 2 >> "$S" 2>&1
cat "$S"
