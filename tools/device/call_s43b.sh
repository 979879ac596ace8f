#!/usr/bin/env bash
# Prepared in the forty-third session, any GPU, ~6 minutes, on this session's third build
# (devbin.tar.xz): quant.cu's staged experts on by default (X8_STAGE 3) with DSV4_FFN1_ROWS 4
# (a verify's 2–4 rows on the two launches), whose n-row form reads the shared expert's gate/up
# rows once for all its rows (X8_SHARED_ONCE 1); kernel directories stage0 (X8_STAGE 0: the rows
# in registers, DSV4_FFN1_ROWS then 1 by default: the form before) and shm0 (X8_SHARED_ONCE 0:
# each row's shared pair its own product, as call_s43a's stage-fr4 ran).
# call_s43a measured the staged kernels: batch 1 −0.23 ms, verify with 4 rows −0.5 to −1 ms,
# but the DSpark draft +0.09 ms and the commit +0.06 ms where neither runs more of them. The
# suspect is the SM's L1 / shared split: the staged kernels need ~120 KB of shared memory an
# SM, and the split they set stays for the kernels after them. DSV4_SMEM_CARVEOUT asks one split
# of every kernel: 58 % (~132 KB, what the staged kernels take) and 100 %.
# - cuda_packed's two-launch test (2, 3 and 4 rows: the shared rows read once) first;
# - batch 1 rounds, three passes over base / stage0 / shm0 / c58 / c100 / stage0 at 58 %;
# - a 2-row step's kernels (verify 1+1's shape) under ncu: base, shm0, stage0;
# - every CUDA test binary at the new default; issue 11's figures (fast mode) at the default.
#   run(command: "bash tools/device/call_s43b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 540
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
envs() {
  case $1 in
    base) ;;
    stage0) echo DSV4_CUDA_KERNELS=.devbin/kvar/stage0 ;;
    c58) echo DSV4_SMEM_CARVEOUT=58 ;;
    c100) echo DSV4_SMEM_CARVEOUT=100 ;;
    stage0c58) echo DSV4_CUDA_KERNELS=.devbin/kvar/stage0 DSV4_SMEM_CARVEOUT=58 ;;
    shm0) echo DSV4_CUDA_KERNELS=.devbin/kvar/shm0 ;;
  esac
}
for pass in 1 2 3; do
  for v in base stage0 shm0 c58 c100 stage0c58; do
    # shellcheck disable=SC2046
    t && batch1_rounds $FL $v-$pass $(envs $v)
    grep -E '^dspark batch +1: draft' "$OUT/ab-$v-$pass.txt" | grep -oE 'commit of.*' >> "$S"
  done
done
for v in base shm0 stage0; do
  # shellcheck disable=SC2046
  t && { env $(envs $v) EXTRA="--reserve 2x4096 --decode-fill clone" CTX=4096 TAG=-b2$v bash tools/device/profile.sh 4 q2 2 > "$OUT/profile-b2$v.txt" 2>&1;
         grep -E '^ *[0-9.]+ +(moe_|quant_x8)|^one step' "$OUT/ncu-q2-2-b2$v.txt" | head -10 | sed "s/^/$v 2 rows: /" >> "$S"; }
done
for tb in cuda_packed cuda_invariance cuda_graph cuda_dspark cuda_rollback cuda_snapshot nonfinite cuda_gguf cuda_backend; do
  t && run_test $tb
done
t && MODES=fast FLASH_LAYERS=$FL bash tools/device/run.sh issue11
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
