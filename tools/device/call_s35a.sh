#!/usr/bin/env bash
# Thirty-fifth session, call a: where a batch-1 step's latency-bound kernels wait, instruction
# by instruction (ncu source counters, 4 q2 layers, context 4096, one step: every launch of the
# kernels below), for the next batch-1 lever (PERF.md "Next (after v43)").
#   run(command: "bash tools/device/call_s35a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
RE='moe_up1s|moe_down1s|index_score_topk|attention_tc|attention_merge|hc_pre_apply_norm|hc_pre_dot|gemv1x4|gemv_route|norm_many'
CTX=4096 EXTRA="--reserve 1x4096 --decode-fill clone" TAG=b1 timeout 400 bash tools/device/ncu_source.sh "$RE" 4 60 > "$OUT/source-run.txt" 2>&1
echo "ncu_source: exit $?" >> "$S"
grep -E '^(== |samples|by reason)' "$OUT/source-1b1.txt" | cut -c1-400 | head -120 >> "$S"
cat "$S"
