#!/usr/bin/env bash
# Twenty-sixth session: tests of this session's changes, then where a served-size exact prefill
# chunk goes with gemvo off / on (and fast mode beside).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
t0=$(date +%s)
run_test cuda_packed many_rows
grep -E "gemvo|moe_upo" "$OUT/test-cuda_packed.txt" | head -8 >> "$S"
run_test cuda_graph
run_test cuda_snapshot
run_test nonfinite
echo "tests took $(( $(date +%s) - t0 )) s" >> "$S"
B=.devbin/dsv4
P="bench --backend cuda --synthetic flash --prefill-chunk 8192 --decode-batches 1 --decode-context 16 --decode-tokens 1"
i=0
for v in "q2 DSV4_GEMVO=1 --cuda-exact" "q2 DSV4_GEMVO=1" "official DSV4_GEMVO=0 --cuda-exact" "official DSV4_GEMVO=1 --cuda-exact"; do
  set -- $v; i=$((i + 1))
  env $2 DSV4_PROFILE_PREFILL=288 timeout 90 $B $P --layers 4 --weights $1 --contexts '' ${3:-} > "$OUT/pp-$i.txt" 2>&1
  echo "== chunk 288, $v: exit $?" >> "$S"
  sed -n "/^profile: one prefill/,/^{/p" "$OUT/pp-$i.txt" | head -24 >> "$S"
done
cat "$S"
