#!/usr/bin/env bash
# Twenty-eighth session: recorded steps up to 128 rows (cuda_graph's new 100- and 80-row steps,
# then the rollback and DSpark tests that replay verify steps), then issue 11's rounds on 4 q2
# layers in fast and exact mode: the batch-16 verify of 1 + 4 rows (80 rows) now replays.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_graph
run_test cuda_rollback
run_test cuda_dspark
FLASH_LAYERS=${FLASH_LAYERS:-4} bash tools/device/run.sh issue11
cat "$S"
