#!/usr/bin/env bash
# Twenty-sixth session: tests of the staging prewarm, gemvo and the expert tiles, the 288-token
# exact prefill profile with the expert tiles off / on, then serving (43 q2 layers; FLASH_LAYERS=32 on an H100).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_packed many_rows
run_test cuda_snapshot
run_test cuda_packed experts int8_products
run_test cuda_invariance
B=.devbin/dsv4
P="bench --backend cuda --synthetic flash --prefill-chunk 8192 --decode-batches 1 --decode-context 16 --decode-tokens 1"
for pairs in 0 4; do
  DSV4_EXPERT_TILE_PAIRS=$pairs DSV4_PROFILE_PREFILL=288 timeout 90 $B $P --layers 4 --weights q2 --contexts '' --cuda-exact > "$OUT/pp-$pairs.txt" 2>&1
  echo "== q2 exact chunk 288, DSV4_EXPERT_TILE_PAIRS=$pairs: exit $?" >> "$S"
  sed -n "/^profile: one prefill/,/^{/p" "$OUT/pp-$pairs.txt" | head -8 >> "$S"
done
bash tools/device/run.sh serve > /dev/null
grep -h "snapshot staging:" /tmp/dsv4-serve-*.log | head -2 >> "$S"
grep -h "queued" /tmp/dsv4-serve-*.log | awk '{print $(NF-1)}' | sort -n | awk '{a[NR]=$1} END {print "queued ms: n",NR,"p50",a[int(NR*0.5)],"p90",a[int(NR*0.9)],"p99",a[int(NR*0.99)],"max",a[NR]}' >> "$S"
grep -c "no staging" /tmp/dsv4-serve-*.log >> "$S"
cat "$S"
