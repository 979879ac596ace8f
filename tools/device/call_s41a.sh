#!/usr/bin/env bash
# Prepared in the forty-first session (PERF.md v49), any GPU, ~8 minutes: the binaries with the
# two-launch experts at 4 / 4 outputs a warp by default (moe_down1s held to 2 blocks an SM).
# The experts table and batch 1 alternating the new default and the old one
# (DSV4_X8_OPW=1,1,1), every CUDA test binary at the new default, then one 4-layer step's
# kernels under ncu (warm caches, real clocks) to pick the next latency-bound kernel.
#   run(command: "bash tools/device/call_s41a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 540
export DSV4_BIN=.devbin/dsv4
experts_table base
experts_table old DSV4_X8_OPW=1,1,1
for v in base old base old; do
  # shellcheck disable=SC2046
  t && batch1_rounds $FL $v-$(date +%s) $([ ${v%%-*} = old ] && echo DSV4_X8_OPW=1,1,1)
done
t && batches_16_64 $FL
t && bash tools/device/run.sh tests
t && { CTX=4096 bash tools/device/profile.sh 4 q2 1 > "$OUT/profile.txt" 2>&1; sed -n '/^one step/,$p' "$OUT/ncu-q2-1.txt" | head -45 >> "$S"; }
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-220 summary.txt
