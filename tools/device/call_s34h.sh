#!/usr/bin/env bash
# call_s34g.sh cut for under 5 minutes of device time: the shared expert's value check, one pass
# of the batch-1 A/B (DSV4_SHARED_X8_ROWS 4 against 1), cuda_invariance, then batches 16 / 64.
#   run(command: "bash tools/device/call_s34h.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
run_test cuda_packed cuda_int8_products_match_the_twin
FL=43; case "$G" in *H100*) FL=32 ;; esac
batch1_rounds $FL shared4 DSV4_SHARED_X8_ROWS=4
batch1_rounds $FL shared1 DSV4_SHARED_X8_ROWS=1
run_test cuda_invariance
batches_16_64 $FL
cat "$S"
