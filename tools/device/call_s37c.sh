#!/usr/bin/env bash
# Prepared in the thirty-seventh session (PERF.md v46), any GPU, ~7 minutes: the CUDA tests with
# the compressors' side branch on by default (DSV4_SIDE=1, steps of up to 16 rows), and the
# batch-1 figures with the defaults.
#   run(command: "bash tools/device/call_s37c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
batch1_rounds $FL defaults
for t in cuda_gguf cuda_graph cuda_dspark cuda_invariance cuda_snapshot cuda_rollback nonfinite cuda_packed; do
  t && run_test $t
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
