#!/usr/bin/env bash
# Forty-second session, any GPU, ~2.5 minutes, on 57e28ab's binaries: the indexer's top-k in
# entry order in fast mode (v51; call_s42c's tkns variant measured −0.10 ms a 32-layer step) and
# comp_pool_row's window loaded at once (b0af3ad: a CSA pooling step's comp_pool_store 22 → ~5
# µs predicted; a step's average moves only if the side branch is on the critical path).
# Checks first: cuda_backend's indexer tests (the fused launch bitwise the separate ones in exact
# and fast mode; rows past 2,048 entries against the CPU), then batch 1 twice (prediction: ~5.61
# ms on an H100, tkns's figure), then every CUDA test binary.
#   run(command: "bash tools/device/call_s42d.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 300
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
run_test cuda_backend index --nocapture
grep -E 'entries bitwise|long index' "$OUT/test-cuda_backend.txt" | cut -c1-200 >> "$S"
for v in base base; do t && batch1_rounds $FL $v-$(date +%s); done
for tb in cuda_backend cuda_invariance cuda_graph cuda_dspark cuda_packed cuda_gguf cuda_rollback cuda_snapshot nonfinite; do
  t && run_test $tb
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
