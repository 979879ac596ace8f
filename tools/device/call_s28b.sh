#!/usr/bin/env bash
# Twenty-eighth session: issue 11's decode and verify rounds on 4 q2 layers, fast then exact,
# with each verify window's step paths (recorded steps up to 128 rows: is the batch-16 verify
# of 1 + 4 rows replayed, and what does it cost).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
FLASH_LAYERS=${FLASH_LAYERS:-4} ROUNDS="--verify-drafts 1,2,3,4" bash tools/device/run.sh issue11
cat "$S"
