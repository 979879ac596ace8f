#!/usr/bin/env bash
# Twenty-ninth session on an H200: 888b461's first GPU run (only the rows that need logits bring
# them: cuda_graph's logits 3/0/1 script, cuda_dspark), then issue 11's 43-layer figures in fast
# mode (run.sh issue11; MODES="fast exact" for both, which may pass one call's 600 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_graph
run_test cuda_dspark
MODES=${MODES:-fast} bash tools/device/run.sh issue11
cat "$S"
