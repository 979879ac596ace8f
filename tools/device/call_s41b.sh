#!/usr/bin/env bash
# Prepared in the forty-first session (PERF.md v49), any GPU, ~4 minutes: decode attention's key
# slices. attention_tc at decode cuts a row's key tiles into S = min(16, ⌈tiles / ATC_MINT⌉)
# slices (ATC_MINT 2: Swa 128 keys 4 slices, Csa 640 keys 16, Hca ~160 keys 5), each block
# loading the row's 64 heads' queries (128 KB f32) and writing 131 KB of partials for
# attention_merge. mint1 / mint4 (kvar: ATC_MINT 1 / 4) against the built-in at batch 1,
# alternating, then batch 16 (which also takes the slices) and the attention tests with the
# faster one if it gains > 0.03 ms.
#   run(command: "bash tools/device/call_s41b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 400
export DSV4_BIN=.devbin/dsv4 DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures
for v in base mint1 mint4 base mint1 mint4; do
  # shellcheck disable=SC2046
  t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v)
done
step() { grep -hE '^decode batch +1 at' "$OUT"/ab-$1-*.txt | grep -oE '[0-9.]+ ms/step' | cut -d' ' -f1 | awk '{s+=$1;n++} END{if(n) printf "%.4f", s/n}'; }
b=$(step base); best=; bt=$b
for v in mint1 mint4; do
  s=$(step $v); echo "mean step $v $s against base $b" >> "$S"
  [ -n "$s" ] && awk -v s="$s" -v b="$bt" 'BEGIN{exit !(s < b - 0.03)}' && { best=$v; bt=$s; }
done
echo "best: ${best:-none}" >> "$S"
if [ -n "$best" ]; then
  for v in base $best; do
    # shellcheck disable=SC2046
    t && ( export $(variant_env $v) X=; timeout 100 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 \
      --contexts '' --reserve 16x4096 --decode-fill clone --decode-batches 16 --decode-context 4096 --decode-tokens 16 \
      > "$OUT/b16-$v.txt" 2>&1; echo "batch 16 with $v: $(grep -E '^decode batch +16 at' "$OUT/b16-$v.txt" | cut -c1-80)" >> "$S" )
  done
  # shellcheck disable=SC2046
  for tb in cuda_backend cuda_invariance cuda_gguf cuda_graph cuda_dspark; do t && ( export $(variant_env $best) X=; run_test $tb ); done
fi
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cd "$OUT" && tar -czf all.tgz --exclude all.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete
cut -c1-200 summary.txt
