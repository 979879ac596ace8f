#!/usr/bin/env bash
# Twenty-eighth session, last call (a976cd3: exact mode's GEMV kernels split rows over the
# grid's y; host vectors given back): the bitwise and invariance checks of those kernels, exact
# decode at 64 rows (call g: 12.488 ms), decode on every row's logits at 64 / 80 / 128 rows
# (call e: 10.79 / 51.70 / 75.53 ms), then the replayed-step test in exact mode.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_packed cuda_bf16_products cuda_exact_products
run_test cuda_invariance
b() {  # TAG BENCH-ARGS...
  local tag=$1; shift
  timeout 60 .devbin/dsv4 bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' \
    --decode-fill clone --decode-context 4096 --decode-tokens 16 "$@" > "$OUT/h-$tag.txt" 2>&1
  echo "== $tag: exit $?" >> "$S"
  grep -E '^decode batch +[0-9]+ at' "$OUT/h-$tag.txt" | sed -E 's/ at context 4096//; s/ extrapolated.*//' >> "$S"
}
b exact --reserve 64x4096 --decode-batches 16,64 --cuda-exact
b logits --reserve 128x4096 --decode-batches 64,80,128 --step-logits
run_test cuda_graph replayed_steps_equal_eager_exact
cat "$S"
