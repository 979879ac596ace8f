#!/usr/bin/env bash
# Prepared in the forty-fourth session (no device was lent then), any GPU, ~8 minutes, on
# devbin.tar.xz (845d977's binaries or later, built by build.sh; PERF.md "Next (after v53)").
# Variants:
# - dk: both draft kernels on (DSV4_MARKOV_FUSED=1, DSV4_BLOCK_ATT_HEADS=1; off by default until
#   they have run on a GPU);
# - u1b4: kernel directory, quant.cu with X8_UP1_BLOCKS 4 (moe_up1s at 64 registers, 4 blocks an
#   SM: the one-row grid's 448 blocks in one wave of 132 SMs instead of 1.13);
# - u1s2: u1b4 with X8_UP1_SHARED 2 (the shared pair's outputs of a y-block over 2 blocks: 512
#   blocks, still one wave);
# - dn8: DSV4_X8_OPW=1,1,1,1,4,8 (moe_down1s at 8 outputs a warp: 512 blocks, one wave at 4 an SM;
#   the shared warp's rows staged in two halves); u1s2dn8 both;
# - f5 / f8: DSV4_FFN1_ROWS 5 / 8 (verify 1+4's and the draft's five rows on the n-row two
#   launches); t0: DSV4_X8_TILES=off (5-row dense products on the dp4a groups).
# In order, each step while time is left:
# - the new kernels' tests: block attention (4 heads a block bitwise a head a block, both against
#   the CPU twin, each form's time), the Markov slot (fused ids bitwise the five ops', its time and
#   GB/s at V4's shape), the fused drafts end to end; the two-launch experts' bitwise test under
#   u1b4, u1s2, dn8 and u1s2dn8;
# - batch 1 on $FL q2 layers (verify 1+1..1+4, the DSpark rounds) over every variant, then the
#   experts table (one-row experts from DRAM and L2) of the expert variants, then a second pass;
# - one draft's kernels under ncu (4 layers) with dk;
# - the CUDA test binaries with dk, u1s2 and dn8.
#   run(command: "bash tools/device/call_s44b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 470
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
run_test cuda_backend block_attention markov --nocapture
grep -E '^(block_attention|markov slot)' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_dspark fused_markov_drafts_equal_the_ops
envs() {
  case $1 in
    dn8) echo DSV4_X8_OPW=1,1,1,1,4,8 ;;
    u1s2dn8) echo DSV4_CUDA_KERNELS=.devbin/kvar/u1s2 DSV4_X8_OPW=1,1,1,1,4,8 ;;
    base) ;;
    dk) echo DSV4_MARKOV_FUSED=1 DSV4_BLOCK_ATT_HEADS=1 ;;
    u1b4) echo DSV4_CUDA_KERNELS=.devbin/kvar/u1b4 ;;
    u1s2) echo DSV4_CUDA_KERNELS=.devbin/kvar/u1s2 ;;
    f5) echo DSV4_FFN1_ROWS=5 ;;
    f8) echo DSV4_FFN1_ROWS=8 ;;
    t0) echo DSV4_X8_TILES=off ;;
  esac
}
for v in u1b4 u1s2 dn8 u1s2dn8; do
  # shellcheck disable=SC2046
  env $(envs $v) timeout 150 .devbin/tests/cuda_packed --test-threads 1 \
      cuda_one_row_experts_in_two_launches_are_bitwise > "$OUT/test-packed-$v.txt" 2>&1
  echo "cuda_packed two-launch test with $v: exit $? $(grep -E '^test result' "$OUT/test-packed-$v.txt")" >> "$S"
done
rounds4() {
  local v=$1; shift
  env "$@" timeout 80 .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$FL" --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/ab-$v.txt" 2>&1
  echo "== $v ($*): exit $?" >> "$S"
  grep -E '^(decode batch +1 at|verify|dspark batch +1(: draft|, measured))' "$OUT/ab-$v.txt" \
    | sed -E 's/ = [0-9.]+x a decode.*//; s/ +[0-9.]+ ms\/layer.*//' | cut -c1-200 >> "$S"
}
# Pass 1 of the rounds, the experts table, then pass 2 (each step while time is left).
for v in base dk u1b4 u1s2 dn8 u1s2dn8 f5 f8 t0; do
  # shellcheck disable=SC2046
  t && rounds4 $v-1 $(envs $v)
done
t && experts_table base
for v in u1b4 u1s2 dn8 u1s2dn8; do
  # shellcheck disable=SC2046
  t && experts_table $v $(envs $v)
done
for v in base dk u1b4 u1s2 dn8 u1s2dn8 f5 f8 t0; do
  # shellcheck disable=SC2046
  t && rounds4 $v-2 $(envs $v)
done
t && { env DSV4_MARKOV_FUSED=1 DSV4_BLOCK_ATT_HEADS=1 bash tools/device/ncu_draft.sh 4 1 > "$OUT/ncu-draft-run.txt" 2>&1;
       sed -n '/^one step/,$p' "$OUT/ncu-draft-1.txt" | head -30 | sed "s/^/dk draft: /" >> "$S"; }
export DSV4_MARKOV_FUSED=1 DSV4_BLOCK_ATT_HEADS=1 DSV4_CUDA_KERNELS=.devbin/kvar/u1s2 DSV4_X8_OPW=1,1,1,1,4,8
for tb in cuda_dspark cuda_packed cuda_gguf cuda_invariance cuda_graph cuda_backend; do
  t && run_test $tb
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
