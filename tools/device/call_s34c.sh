#!/usr/bin/env bash
# call_s34a.sh and call_s34b.sh in one call for a short device budget: the value checks (block
# attention against its CPU twin, the int8 products with pairs off and on, cuda_dspark,
# invariance, graphs), then issue 11's figures with the pairs on (43 q2 layers on an H200, 32 on
# an H100) and batch 1's verify and DSpark rounds with them off.
#   run(command: "bash tools/device/call_s34c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
run_test cuda_backend cuda_block_attention_matches_the_cpu_twin --nocapture
grep -E '^block_attention' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_packed cuda_int8_products_match_the_twin
run_test cuda_invariance
run_test cuda_graph
run_test cuda_dspark
FL=43; case "$G" in *H100*) FL=32 ;; esac
for p in 1 0; do
  B=1,16,64; [ $p = 0 ] && B=1
  DSV4_ROW_PAIRS=$p timeout 200 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 64x4096 --decode-fill clone --decode-batches $B --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/issue11-pairs$p.txt" 2>&1
  echo "== flash q2 $FL layers, DSV4_ROW_PAIRS=$p: exit $?" >> "$S"
  grep -E '^(decode batch|verify|dspark batch +[0-9]+(: draft|, measured))' "$OUT/issue11-pairs$p.txt" | cut -c1-200 >> "$S"
done
cat "$S"
