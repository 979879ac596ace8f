#!/usr/bin/env bash
# Thirty-fifth session, call b: the experts table of the kernel bench (a MoE block's routed and
# shared experts at 1 and 3 rows, weights from DRAM and from L2) under the expert kernels'
# variants, then ncu's source counters of a batch-1 step's latency-bound kernels.
#   run(command: "bash tools/device/call_s35b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
E="--backend cuda --synthetic kernels --tables experts"
for v in base pf512 up4b dn5b sel16 pf1024 pipe2; do
  case $v in
    base) env=() ;;
    sel16) env=(DSV4_CUDA_KERNELS=.devbin/kvar/sel16) ;;
    pf512) env=(DSV4_CUDA_KERNELS=.devbin/kvar/pf512) ;;
    pf1024) env=(DSV4_CUDA_KERNELS=.devbin/kvar/pf1024) ;;
    up4b) env=(DSV4_CUDA_KERNELS=.devbin/kvar/up4b) ;;
    dn5b) env=(DSV4_CUDA_KERNELS=.devbin/kvar/dn5b) ;;
    pipe2) env=(DSV4_X8_PIPE=2) ;;
  esac
  t0=$(date +%s)
  env "${env[@]}" timeout 120 .devbin/dsv4 bench $E > "$OUT/experts-$v.txt" 2>&1
  echo "== $v (${env[*]}): exit $? in $(( $(date +%s) - t0 )) s" >> "$S"
  grep -E '^experts|rror' "$OUT/experts-$v.txt" | cut -c1-200 >> "$S"
done
RE='moe_up1s|moe_down1s|index_score_topk|attention_tc|hc_pre_apply_norm'
CTX=4096 EXTRA="--reserve 1x4096 --decode-fill clone" TAG=b1 timeout 230 bash tools/device/ncu_source.sh "$RE" 4 24 > "$OUT/source-run.txt" 2>&1
echo "ncu_source: exit $?" >> "$S"
grep -E '^(== |samples|by reason)' "$OUT/source-1b1.txt" | cut -c1-400 | head -80 >> "$S"
cat "$S"
