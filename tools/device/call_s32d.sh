#!/usr/bin/env bash
# Thirty-second session's last call (little device time left): cuda_dspark on the Markov loop's
# device ids (the GPU drafts against the CPU's, alone and batched), then the DSpark round at 4 q2
# layers, batch 1, on these binaries and on 04c8d31's (.devbin/dsv4-old), as far as time allows.
#   run(command: "bash tools/device/call_s32d.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_dspark
cat "$S"
for bin in dsv4 dsv4-old; do
  timeout 100 .devbin/$bin bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --dspark-round 2>&1 | grep -E '^(decode|dspark batch)' | cut -c1-200
  echo "== $bin: exit ${PIPESTATUS[0]}"
done
