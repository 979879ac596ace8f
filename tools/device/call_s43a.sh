#!/usr/bin/env bash
# Prepared in the forty-third session, any GPU, ~8 minutes, on this session's build (devbin.tar.xz):
# the two-launch experts' rows through shared memory (quant.cu X8_STAGE, off; kernel directories
# stu = 1, moe_up1s's routed IQ2_XXS rows; std = 2, moe_down1s's rows; stage = 3, both).
# - cuda_packed's two-launch test under stage (V4's widths 4,096 / 2,048 are new cases: whole
#   rounds, the staged rows), then the built-in's;
# - the experts table (one-row experts, DRAM / L2 µs) for base, stu, std, stage;
# - batch 1 base / stage alternating (verify 1+1..1+3, the DSpark rounds), and stage with the
#   two launches taking verify rows (DSV4_FFN1_ROWS=4: each pair a one-row product);
# - one 4-layer step under ncu each way; every CUDA test binary under stage;
# - issue 11's figures at the built-in (fast mode) if time is left.
# Prediction: one-row experts 47 / 37 µs (DRAM / L2) → ~30 / ~22; batch 1 −0.3 to −0.5 ms on 32
# layers (5.57 → ~5.1–5.3 on an H100).
#   run(command: "bash tools/device/call_s43a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 540
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
( export DSV4_CUDA_KERNELS=.devbin/kvar/stage; echo "stage (X8_STAGE 3):" >> "$S"
  run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise --nocapture
  grep -E 'two launches bitwise' "$OUT/test-cuda_packed.txt" | cut -c1-200 >> "$S"
  mv "$OUT/test-cuda_packed.txt" "$OUT/test-cuda_packed-stage2l.txt" )
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
for v in base stu std stage; do t && experts_table $v $(variant_env $v); done
for v in base stage base stage; do
  # shellcheck disable=SC2046
  t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v)
done
t && batch1_rounds $FL stage-fr4 DSV4_CUDA_KERNELS=.devbin/kvar/stage DSV4_FFN1_ROWS=4
for v in base stage; do
  # shellcheck disable=SC2046
  t && { env $(variant_env $v) CTX=4096 TAG=-$v bash tools/device/profile.sh 4 q2 1 > "$OUT/profile-$v.txt" 2>&1;
         grep -E '^ *[0-9.]+ +(moe_|gemv1x|gemvx)|^one step' "$OUT/ncu-q2-1-$v.txt" | head -10 | sed "s/^/$v: /" >> "$S"; }
done
( export DSV4_CUDA_KERNELS=.devbin/kvar/stage; echo "under stage:" >> "$S"
  for tb in cuda_packed cuda_backend cuda_invariance cuda_graph cuda_dspark cuda_gguf cuda_rollback cuda_snapshot nonfinite; do
    t && { run_test $tb; mv "$OUT/test-$tb.txt" "$OUT/test-$tb-stage.txt"; }
  done )
t && MODES=fast FLASH_LAYERS=$FL ROUNDS="--verify-drafts 1,2,3,4 --dspark-round" bash tools/device/run.sh issue11
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
