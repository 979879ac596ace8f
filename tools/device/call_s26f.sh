#!/usr/bin/env bash
# Twenty-sixth session, last call: the snapshot test, then serving (43 q2 layers on an H200;
# FLASH_LAYERS=32 on an H100) with the staging pool page-locked at start and the snapshot table
# uploaded from it.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_snapshot
bash tools/device/run.sh serve
