#!/usr/bin/env bash
# Forty-second session, any GPU, ~5 minutes, on binaries of this session's HEAD (v50's defaults
# built in: attention_tcd, ATM_WARP 1; route_row's register form, not yet run), with kernel
# directories rt0 (common.cuh without the register form: route_row as before), tkns (attention.cu
# with TOPK_SORT 0: the indexer's k chosen entries unsorted, a timing variant) and atm0
# (ATM_WARP 0). (1) Batch 1 alternating base / rt0 / tkns, twice. Predictions: rt0 +1 to +2 µs a
# learned-router layer (+0.03 to +0.06 ms a 32-layer step) against base; tkns −3 to −6 µs a
# CSA layer if the bitonic sort is a large part of index_score_topk's 23.5 µs. (2) The router
# tests (cuda_packed: the CPU's choices with ties at 256 / 300 experts, gemv_route bitwise route)
# and every CUDA test binary at the new defaults. (3) One 4-layer step's per-node table, the
# indexer's scores and top-k as two launches (DSV4_INDEX_FUSED=0), and the built-in's; (4) the
# per-node table of a 2-row step.
#   run(command: "bash tools/device/call_s42c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 560
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
run_test cuda_packed router --nocapture
grep -E 'experts, [0-9]+ rows' "$OUT/test-cuda_packed.txt" | head -4 >> "$S"
for v in base rt0 tkns base rt0 tkns; do
  # shellcheck disable=SC2046
  t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v)
done
t && { CTX=4096 TAG=-base bash tools/device/profile.sh 4 q2 1 > "$OUT/profile.txt" 2>&1;
       grep -E '^ *[0-9.]+ +(index|gemv_route|attention)|^one step' "$OUT/ncu-q2-1-base.txt" | head -20 >> "$S"; }
t && { DSV4_INDEX_FUSED=0 CTX=4096 TAG=-split bash tools/device/profile.sh 4 q2 1 > "$OUT/profile2.txt" 2>&1;
       grep -E '^ *[0-9.]+ +(index|norm_many|gemvt)|^one step' "$OUT/ncu-q2-1-split.txt" | head -20 >> "$S"; }
# Where a 2-row step's time goes (a verify 1+1 costs ~1.22 decode steps, +39 µs a layer).
t && { EXTRA="--reserve 2x4096 --decode-fill clone" CTX=4096 TAG=-b2 bash tools/device/profile.sh 4 q2 2 > "$OUT/profile3.txt" 2>&1;
       grep -E '^one step' -A24 "$OUT/ncu-q2-2-b2.txt" >> "$S"; }
for tb in cuda_packed cuda_invariance cuda_graph cuda_dspark cuda_gguf cuda_rollback cuda_snapshot nonfinite cuda_backend; do
  t && run_test $tb
done
t && batches_16_64 $FL
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
