#!/usr/bin/env bash
# Prepared in the forty-first session (PERF.md "Next (after v49)" item 1), any GPU, ~6 minutes:
# decode attention's slices on blocks of 16 heads (attention_tcd, DSV4_ATT_TC_HEADS=16), not yet
# run on a GPU. First its checks (cuda_backend's decode-slice tests at 64 and 16 heads against
# the f32 kernel and the CPU, then cuda_invariance / cuda_gguf / cuda_graph / cuda_dspark under
# att16), then batch 1 alternating the built-in and att16, batch 16 each way, and one 4-layer
# step's kernels under ncu with att16 (attention_tcd against attention_tc's 16–19 µs a layer).
# Prediction: attention_tc 16–19 → ~7–10 µs a layer, the merge unchanged; −0.2 to −0.35 ms a
# 32-layer step. Added in the forty-second session: atmw16, att16 with attention_merge's slice
# statistics a lane a slice (kvar/atmw: ATM_WARP 1; 1,056 SASS instructions against 1,992), its
# decode-slice test, and a third column in the batch-1 A/B. Prediction: the merge Swa 7.0 / Csa
# 8.3 µs → ~5, ~−0.08 ms a 32-layer step.
#   run(command: "bash tools/device/call_s42a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 540
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
run_test cuda_backend decode_attention_slices --nocapture
grep -E 'attention_tc slices of' "$OUT/test-cuda_backend.txt" | cut -c1-200 >> "$S"
# L2 prefetch blocks on the 16-head grid change no value either.
t && ( export DSV4_ATT_TC_HEADS=16; run_test cuda_backend l2_prefetch )
t && ( export DSV4_CUDA_KERNELS=.devbin/kvar/atmw; run_test cuda_backend decode_attention_slices --nocapture;
        grep -E 'attention_tc slices of' "$OUT/test-cuda_backend.txt" | sed 's/^/atmw: /' | cut -c1-200 >> "$S" )
for tb in cuda_invariance cuda_gguf cuda_graph cuda_dspark; do t && ( export DSV4_ATT_TC_HEADS=16; run_test $tb ); done
for v in base att16 atmw16 base att16 atmw16; do
  # shellcheck disable=SC2046
  t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v)
done
for v in base att16; do
  # shellcheck disable=SC2046
  t && ( export $(variant_env $v) X=; timeout 100 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 \
    --contexts '' --reserve 16x4096 --decode-fill clone --decode-batches 16 --decode-context 4096 --decode-tokens 16 \
    > "$OUT/b16-$v.txt" 2>&1; echo "batch 16 with $v: $(grep -E '^decode batch +16 at' "$OUT/b16-$v.txt" | cut -c1-80)" >> "$S" )
done
t && { DSV4_ATT_TC_HEADS=16 CTX=4096 TAG=-att16 bash tools/device/profile.sh 4 q2 1 > "$OUT/profile.txt" 2>&1;
       grep -E '^ *[0-9.]+ +attention|^one step' "$OUT/ncu-q2-1-att16.txt" | head -12 >> "$S"; }
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
