#!/usr/bin/env bash
# Twenty-seventh session: the snapshot test (a background half that waits for a staging buffer,
# a table from a slab), then serving 43 q2 layers on an H200 (FLASH_LAYERS=32 on an H100):
# queued-ms stats on the engine thread, and how the no-buffer snapshots copied.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_snapshot
bash tools/device/run.sh serve > /dev/null
grep -h "snapshot staging:" /tmp/dsv4-serve-*.log | head -2 >> "$S"
grep -h "snapshot queued" /tmp/dsv4-serve-*.log | awk '{print $(NF-1)}' | sort -n | awk '{a[NR]=$1} END {print "queued ms: n",NR,"p50",a[int(NR*0.5)],"p90",a[int(NR*0.9)],"p99",a[int(NR*0.99)],"max",a[NR]}' >> "$S"
echo "no staging buffer at begin: $(grep -ch 'no staging' /tmp/dsv4-serve-*.log); staged after a wait: $(grep -ch 'staged after a wait' /tmp/dsv4-serve-*.log); pageable: $(grep -ch 'pageable' /tmp/dsv4-serve-*.log)" >> "$S"
grep -h 'staged after a wait' /tmp/dsv4-serve-*.log | sed 's/.*download \([0-9.]*\) ms.*, \([0-9.]*\) ms of it waiting.*/\2/' | sort -n | awk '{a[NR]=$1} END {if (NR) print "waited ms: p50",a[int(NR*0.5)+1],"max",a[NR]}' >> "$S"
cat "$S"
# Then issue 11's bf16 figure and the kernel table (weights rotated so they come from DRAM).
bash tools/device/run.sh flash-bf16 kernels > /dev/null
tail -40 "$S"
