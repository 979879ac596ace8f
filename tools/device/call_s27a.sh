#!/usr/bin/env bash
# Twenty-seventh session: the snapshot test (a background half that waits for a staging buffer,
# a table from a slab), then serving 43 q2 layers on an H200 (FLASH_LAYERS=32 on an H100):
# queued-ms stats on the engine thread, and how the no-buffer snapshots copied.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_snapshot
# Then issue 11's bf16 figure and the kernel table (weights rotated so they come from DRAM).
bash tools/device/run.sh serve flash-bf16 kernels
