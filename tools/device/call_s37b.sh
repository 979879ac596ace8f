#!/usr/bin/env bash
# Prepared in the thirty-seventh session (PERF.md v46), any GPU, ~4 minutes: the side branches
# one by one (DSV4_SIDE, a mask: 1 the compressors, 2 the indexer's query product, 4 the shared
# expert beside the router) at batch 1 (decode, verify 1+1..1+3, DSpark rounds), after the side
# test (fixed: the 40-row chunk's last row).
#   run(command: "bash tools/device/call_s37b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 330
for m in 0 3 1 4 7 0; do
  t && batch1_rounds $FL mask$m-$(date +%s) DSV4_SIDE=$m
done
t && run_test cuda_gguf cuda_gguf_side_branch_is_bitwise --nocapture
grep -E '^exact' "$OUT/test-cuda_gguf.txt" >> "$S"
t && { DSV4_SIDE=0 batches_16_64 $FL; mv "$OUT/b1664.txt" "$OUT/b1664-side0.txt"; }
t && { DSV4_SIDE=3 batches_16_64 $FL; }
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
