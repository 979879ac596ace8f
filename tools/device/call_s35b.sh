#!/usr/bin/env bash
# Thirty-fifth session, call b: the experts table of the kernel bench (a MoE block's routed and
# shared experts at 1 and 3 rows, weights from DRAM and from L2) under the expert kernels'
# variants, then ncu's source counters of a batch-1 step's latency-bound kernels.
#   run(command: "bash tools/device/call_s35b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
for v in base pf512 up4b dn5b sel16 pf1024 pipe2; do
  case $v in
    base) experts_table base ;;
    pipe2) experts_table pipe2 DSV4_X8_PIPE=2 ;;
    *) experts_table $v DSV4_CUDA_KERNELS=.devbin/kvar/$v ;;
  esac
done
RE='moe_up1s|moe_down1s|index_score_topk|attention_tc|hc_pre_apply_norm'
CTX=4096 EXTRA="--reserve 1x4096 --decode-fill clone" TAG=b1 timeout 230 bash tools/device/ncu_source.sh "$RE" 4 24 > "$OUT/source-run.txt" 2>&1
echo "ncu_source: exit $?" >> "$S"
grep -E '^(== |samples|by reason)' "$OUT/source-1b1.txt" | cut -c1-400 | head -80 >> "$S"
cat "$S"
