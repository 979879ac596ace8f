#!/usr/bin/env bash
# Twenty-eighth session, final binaries (grouped experts to 128 rows in fast mode, recorded
# steps to 128 rows, the bench on greedy ids): the CUDA tests those changes touch, then issue
# 11's bench rounds on 4 q2 layers (FLASH_LAYERS), fast and exact.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_graph
run_test cuda_packed
run_test cuda_invariance
run_test cuda_dspark
run_test cuda_rollback
run_test cuda_backend
FLASH_LAYERS=${FLASH_LAYERS:-4} ROUNDS="--verify-drafts 1,2,3,4" bash tools/device/run.sh issue11
cat "$S"
