#!/usr/bin/env bash
# Twenty-seventh session on an H200 (after call_s27a's checks on an H100): serving 43 q2 layers
# with the waiting staging pool (run.sh serve reports the engine-side snapshot stats), issue 11's
# bf16 figure and the kernel table from DRAM.
set -uo pipefail
cd "$(dirname "$0")/../.."
tar -xJf devbin.tar.xz
bash tools/device/run.sh serve flash-bf16 kernels
