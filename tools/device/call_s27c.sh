#!/usr/bin/env bash
# Twenty-seventh session on an H200 (after call_s27a's checks on an H100): serving 43 q2 layers
# with the waiting staging pool, issue 11's bf16 figure and the kernel table from DRAM.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -x .devbin/dsv4 ] || tar -xJf devbin.tar.xz
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
S=$OUT/summary.txt
bash tools/device/run.sh serve > /dev/null
grep -h "snapshot queued" /tmp/dsv4-serve-*.log | awk '{print $(NF-1)}' | sort -n | awk '{a[NR]=$1} END {print "queued ms: n",NR,"p50",a[int(NR*0.5)],"p90",a[int(NR*0.9)],"p99",a[int(NR*0.99)],"max",a[NR]}' >> "$S"
echo "no staging buffer at begin: $(grep -ch 'no staging' /tmp/dsv4-serve-*.log); staged after a wait: $(grep -ch 'staged after a wait' /tmp/dsv4-serve-*.log); pageable: $(grep -ch 'pageable' /tmp/dsv4-serve-*.log)" >> "$S"
bash tools/device/run.sh flash-bf16 kernels > /dev/null
cat "$S"
