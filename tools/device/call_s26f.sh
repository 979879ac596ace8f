#!/usr/bin/env bash
# Twenty-sixth session, last call: the snapshot test, then serving (43 q2 layers on an H200;
# FLASH_LAYERS=32 on an H100) with the staging pool page-locked at start and the snapshot table
# uploaded from it.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_snapshot
bash tools/device/run.sh serve > /dev/null
grep -h "snapshot staging:" /tmp/dsv4-serve-*.log | head -2 >> "$S"
grep -h "queued" /tmp/dsv4-serve-*.log | awk '{print $(NF-1)}' | sort -n | awk '{a[NR]=$1} END {print "queued ms: n",NR,"p50",a[int(NR*0.5)],"p90",a[int(NR*0.9)],"p99",a[int(NR*0.99)],"max",a[NR]}' >> "$S"
echo "no staging buffer: $(grep -ch 'no staging' /tmp/dsv4-serve-*.log)" >> "$S"
cat "$S"
