#!/usr/bin/env bash
# Twenty-eighth session: fast mode's routed experts past N rows on the tensor-core tiles
# (pgemm_experts: each active expert's weights read and decoded once a tile) instead of the
# grouped dp4a kernels (once a pair): DSV4_GROUPED_MAX_ROWS = 64 (built in), 32, 16, 8 at
# 4 q2 layers, context 4096, greedy ids; decode 1 / 16 / 32 / 64 and verify 1 + 1, 3, 4.
# GROUPED, LAYERS, RESERVE, BATCHES, DRAFTS vary it (GROUPED up to 128 after call s28f).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
for g in ${GROUPED:-64 32 16 8 64}; do
  timeout 150 env DSV4_GROUPED_MAX_ROWS=$g .devbin/dsv4 bench --backend cuda --synthetic flash --layers ${LAYERS:-4} --weights q2 \
    --contexts '' --reserve ${RESERVE:-64}x4096 --decode-fill clone --decode-context 4096 --decode-tokens 16 \
    --decode-batches ${BATCHES:-1,16,32,64} --verify-drafts ${DRAFTS:-1,3,4} > "$OUT/g$g.txt" 2>&1
  echo "== grouped max rows $g: exit $?" >> "$S"
  grep -E '^(decode batch +[0-9]+ at|verify batch +[0-9]{2})' "$OUT/g$g.txt" | sed -E 's/ at context 4096//; s/ extrapolated.*//; s/; all .*steps/; steps/' | cut -c1-110 >> "$S"
done
cat "$S"
