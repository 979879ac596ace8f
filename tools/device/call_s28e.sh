#!/usr/bin/env bash
# Twenty-eighth session: is the cliff past 64 rows (decode 80 rows 40 ms against 10 for 64,
# both replayed, ~14 ms of kernels) the host's logits copy? Each step's logits Vec (80 rows:
# 41 MB) is past glibc's 32 MiB mmap threshold, so every step maps and faults in fresh pages.
# 4 q2 layers, fast mode, decode 64 / 80 / 128: greedy ids (the default now), every row's
# logits (--step-logits), and the logits with glibc's mmap off; then verify rounds on ids.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run() {  # TAG [ENV...] -- BENCH ARGS
  local tag=$1; shift
  timeout 150 env "$@" .devbin/dsv4 bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' \
    --reserve 128x4096 --decode-fill clone --decode-context 4096 --decode-tokens 16 ${BARGS} > "$OUT/e-$tag.txt" 2>&1
  echo "== $tag: exit $?" >> "$S"
  grep -E '^(decode batch|verify)' "$OUT/e-$tag.txt" | cut -c1-120 >> "$S"
}
BARGS="--decode-batches 64,80,128 --verify-drafts 1,4" run ids X=1
BARGS="--decode-batches 64,80,128 --step-logits" run logits X=1
BARGS="--decode-batches 64,80,128 --step-logits" run logits-nommap MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736
BARGS="--decode-batches 1,16,64 --verify-drafts 1,2,3,4 --cuda-exact" run exact-ids X=1
cat "$S"
