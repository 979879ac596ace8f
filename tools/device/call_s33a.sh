#!/usr/bin/env bash
# Prepared in the thirty-second session for the next (any GPU): the first GPU run of 657699b
# (PERF.md v41: the Markov loop's ids stay on the device; a lone greedy draft skips its logits)
# and of 94beae5 (moe_downx_q2_k at 5 blocks) built in. Value checks (cuda_dspark compares the
# GPU drafts with the CPU's, batched and alone), then the DSpark round at 4 q2 layers, batches 1
# and 16, on these binaries and on 04c8d31's (`.devbin/dsv4-old`: the loop with a round trip a
# slot). The bench prints each draft's split: stages + LM head, Markov loop. Then one draft's
# kernels under ncu (ncu_draft.sh): their sum against the draft's wall time.
#   after build.sh: `tar -xJf <04c8d31's devbin.tar.xz> .devbin/dsv4 -O > .devbin/dsv4-old`
#   (chmod +x), then pack devbin.tar.xz: run(command: "bash tools/device/call_s33a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_dspark
run_test cuda_packed
run_test cuda_graph
run_test cuda_invariance
for bin in dsv4 dsv4-old; do
  timeout 200 .devbin/$bin bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' \
      --reserve 16x4096 --decode-fill clone --decode-batches 1,16 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3 --dspark-round > "$OUT/round-$bin.txt" 2>&1
  echo "== $bin: exit $?" >> "$S"
  grep -E '^(decode|dspark batch)' "$OUT/round-$bin.txt" | cut -c1-200 >> "$S"
done
echo "== one draft's kernels (ncu, batch 1)" >> "$S"
timeout 240 bash tools/device/ncu_draft.sh 4 1 >> "$S" 2>&1
cat "$S"
