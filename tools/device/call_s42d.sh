#!/usr/bin/env bash
# Prepared in the forty-second session, any GPU, ~4 minutes, on 925492c's binaries (devbin.tar.xz):
# - the indexer's top-k in entry order in fast mode (v51, on by default, not yet run; call_s42c's
#   tkns variant measured −0.10 ms a 32-layer step): cuda_backend's indexer tests first (the
#   fused launch bitwise the separate ones in exact and fast mode; rows past 2,048 entries
#   against the CPU), then every CUDA test binary;
# - comp_pool_row's window loaded at once (CP_FAST, off; kernel directory cpf with CP_FAST 1):
#   cuda_backend under cpf, batch 1 base / cpf alternating, and one pooling step's kernels under
#   ncu each way (CTX 4095: the profiled row at position 4095 closes a CSA and an HCA window).
#   Prediction: comp_pool_store at a CSA pooling step 22 / 12.6 µs → ~5 / ~4; batch 1 (16 steps,
#   4 of them pooling) −0 to −0.1 ms, depending on whether the side branch is on the critical
#   path. Flip CP_FAST's default if cpf's tests pass and batch 1 does not lose.
#   run(command: "bash tools/device/call_s42d.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 480
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
run_test cuda_backend index --nocapture
grep -E 'entries bitwise|long index' "$OUT/test-cuda_backend.txt" | cut -c1-200 >> "$S"
for v in base cpf base cpf; do
  # shellcheck disable=SC2046
  t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v)
done
for v in base cpf; do
  # shellcheck disable=SC2046
  t && { env $(variant_env $v) CTX=4095 TAG=-$v bash tools/device/profile.sh 4 q2 1 > "$OUT/profile-$v.txt" 2>&1;
         grep -E '^ *[0-9.]+ +(comp_pool|gemvt|index_score)|^one step' "$OUT/ncu-q2-1-$v.txt" | head -12 | sed "s/^/$v: /" >> "$S"; }
done
t && ( export DSV4_CUDA_KERNELS=.devbin/kvar/cpf; echo "cpf (CP_FAST 1):" >> "$S"; run_test cuda_backend )
for tb in cuda_backend cuda_invariance cuda_graph cuda_dspark cuda_packed cuda_gguf cuda_rollback cuda_snapshot nonfinite; do
  t && run_test $tb
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
