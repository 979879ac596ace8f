#!/usr/bin/env bash
# One device session's checks and measurements (see tools/device/build.sh):
#   run(command: "bash tools/device/run.sh [PART...]", carry: [".devbin"])
# PARTs, in the order given (default: tests kernels flash-exact flash-int8): tests, kernels,
# flash-exact, flash-int8 (the 43-layer q2 bench on the exact and the int8-activation products),
# flash-b64 (batches 1 / 16 / 64 on contexts cloned from one prefilled sequence), fusions (the
# decode fusions off / on at batches 1, 16, 64), rowcaps (the 2- and 4-row int8 kernels against
# the general ones: steps, verify, kernel table), attslices (decode attention on attention_tc's
# key slices against the f32 kernel), l2pf (L2 prefetch blocks in HC_PRE), hcprobe (HC_PRE's apply
# launched twice: cold against warm), pipe-tests and pipe (the software-pipelined one-row int8
# kernels: bitwise checks; A/Bs at 4 and 43 layers), prof16 (a batch-16 step's kernels under ncu),
# stalls (ncu's stall reasons of the slow kernels at batches 64 / 16 / 1), v28 (PERF.md v28's open
# questions: the IQ2_XXS selectors' copies, XT_CG, tile rounds with L2 hints), v29 (the dense
# tiles' blocks an SM under ncu), v29cp (the dense Q8_0 tiles on cp.async: checks, ncu, A/B), v30
# (HC_PRE's pole; per-instruction stall samples), v30xs (expert activations staged in shared
# memory), v30pre (moe_upx's table after its first loads), v30sink (the Sinkhorn's dummy lanes),
# srcall (every kernel's slow-path calls and local memory, ncu source counters), b64ab (batch
# 64's products on the int8 tiles), flash-served (43 q2 layers in serve's exact mode), flash-bf16
# (4 bf16 layers), prefill (issue 12's prefill figures and a stage profile), hf (HF
# transformers' prefill beside dsv4's), serve (bench_serve at 1 / 16 / 64).
# Writes each part's output and a summary to $OUT (or /tmp/dsv4-out); the device tool brings back
# at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
export DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures DSV4_BIN=$PWD/.devbin/dsv4
S=$OUT/summary.txt
B=.devbin/dsv4
[ -s "$S" ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$S" 2>&1
PARTS=${*:-tests kernels flash-exact flash-int8}
FL=${FLASH_LAYERS:-43}  # flash-served and serve: the layers (43 q2 layers need an H200; ~32 fit an H100)
# SERVE_LEVELS: serve's concurrency levels (1,16,64); SERVE_EXTRA: more `dsv4 serve` flags;
# SERVE_BENCH: more bench_serve flags (`--temperature 0.8 --top-p 0.95`: sampled requests)
t1() {  # NAME [ENV...] BINARY [FILTER]: one test binary, its result into the summary
    local name=$1; shift
    env "$@" --test-threads 1 > "$OUT/test-$name.txt" 2>&1
    echo "test $name: exit $? $(grep -E '^test result' "$OUT/test-$name.txt" | tail -1)" >> "$S"
    grep -E -A3 '^test .*FAILED|panicked' "$OUT/test-$name.txt" | head -12 >> "$S"
}
ncu_each() {  # BATCH REGEX VARIANT...: one 4-layer step under ncu with each kernel directory
    # (.devbin/kvar/VARIANT; builtin: none), the kernels matching REGEX into the summary
    local b=$1 re=$2 v
    shift 2
    for v in "$@"; do
        local E=()
        [ "$v" = builtin ] || E=("DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/$v")
        env "${E[@]}" CTX=4096 TAG=-$v bash tools/device/profile.sh 4 q2 "$b" > /dev/null 2>&1
        echo "ncu, 4 q2 layers at context 4096, batch $b, $v: $(grep -E "^($re|one step)" "$OUT/ncu-q2-$b-$v.txt" \
            | head -8 | tr -s ' ' | tr '\n' ';')" >> "$S"
    done
}
ab_each() {  # BATCHES VARIANT...: the 4-layer step A/B (ab_step.sh) at each of the comma-separated batches
    local bs=$1 b
    shift
    for b in ${bs//,/ }; do
        echo "4 q2 layers, batch $b:" >> "$S"
        local E=""
        [ "$b" = 64 ] && E="--reserve 64x4096 --decode-fill clone"
        EXTRA="$E" LAYERS=4 BATCH=$b bash tools/device/ab_step.sh "$@" >> "$S" 2>&1
    done
}
for part in $PARTS; do
    case $part in
    tests)
        # Every test binary's output in one file.
        T=$OUT/tests.txt
        : > "$T"
        for t in .devbin/tests/*; do
            n=$(basename "$t")
            echo "==== $n" >> "$T"
            RUST_BACKTRACE=1 timeout 300 "$t" --test-threads 1 > /tmp/test-$n.txt 2>&1
            rc=$?
            cat /tmp/test-$n.txt >> "$T"
            echo "test $n: exit $rc $(grep -E '^test result' /tmp/test-$n.txt | tail -1)" >> "$S"
            grep -E -A3 '^test .*FAILED|panicked' /tmp/test-$n.txt | head -12 >> "$S"
        done
        ;;
    kernels)
        timeout 240 $B bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
        echo "kernels: exit $?" >> "$S"
        grep -E '^ *(int8 +)?[A-Za-z0-9_]+ +\[' "$OUT/kernels.txt" | cut -c1-170 >> "$S"
        ;;
    flash-exact | flash-int8)
        mode=${part#flash-}
        # Batches 1 and 16 at context 4096 (16 sequences prefilled first).
        F="bench --backend cuda --synthetic flash --layers 43 --weights q2 --reserve 16x4096 --contexts 2048 \
           --prefill-chunk 8192 --decode-batches 1,16 --decode-context 4096 --decode-tokens 16 --verify-drafts 1,2,4 --dspark-round"
        env DSV4_INT8=$([ "$mode" = int8 ] && echo 1 || echo 0) timeout 420 $B $F > "$OUT/flash-q2-$mode.txt" 2>&1
        echo "flash q2 43 layers ($mode): exit $?" >> "$S"
        grep -E '^(prefill|decode|verify|dspark)' "$OUT/flash-q2-$mode.txt" | cut -c1-220 >> "$S"
        ;;
    issue11)
        # Every figure issue 11's acceptance names, at the binaries' commit, in one part: 43 q2
        # layers at context 4096 (batches 1 / 16 / 64, verify 1+1..1+4, the DSpark round), fast
        # mode (bench's default) then exact mode (serve's default, what bench_serve compares
        # with); then 4 bf16 layers at batch 1 and the kernel table (weights from DRAM).
        # FLASH_LAYERS (32 fit an H100), MODES ("fast exact"), ROUNDS ("--verify-drafts 1,2,3,4
        # --dspark-round"; empty: decode only).
        for mode in ${MODES:-fast exact}; do
            E=""; [ $mode = exact ] && E="--cuda-exact"
            timeout 330 $B bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' --reserve 64x4096 \
                --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 \
                ${ROUNDS---verify-drafts 1,2,3,4 --dspark-round} $E > "$OUT/issue11-$mode.txt" 2>&1
            echo "flash q2 $FL layers ($mode): exit $?" >> "$S"
            grep -E '^(decode|verify|dspark)' "$OUT/issue11-$mode.txt" | cut -c1-230 >> "$S"
        done
        ;;
    flash-b64)
        # Issue 11's batch 64 at context 4096 (with 1 and 16 beside it): the first sequence is
        # prefilled and the other 63 restored from its snapshot (--decode-fill clone; prefilling
        # all 64 took ~4 minutes).
        timeout 300 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts '' --reserve 64x4096 \
            --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 > "$OUT/flash-b64.txt" 2>&1
        echo "flash q2 43 layers, batch 64 (cloned contexts): exit $?" >> "$S"
        grep -E '^decode' "$OUT/flash-b64.txt" | cut -c1-220 >> "$S"
        ;;
    fusions)
        # The decode fusions' A/B in one process (one weight draw): batches 1 / 16 / 64 at
        # context 4096 with the ten fusions off, then on (--decode-fusions 0,1), the kernels a
        # layer each way, then the verify and DSpark rounds with them on.
        timeout 540 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts '' --reserve 64x4096 \
            --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 --decode-fusions 0,1 \
            --verify-drafts 1,2,3,4 --dspark-round > "$OUT/fusions.txt" 2>&1
        echo "flash q2 43 layers, fusions off / on: exit $?" >> "$S"
        grep -E '^(decode|verify|dspark)' "$OUT/fusions.txt" | cut -c1-230 >> "$S"
        ;;
    rowcaps)
        # PERF.md v24's A/B: the int8 kernels built for 2 and 4 rows (DSV4_ROW_CAPS=1) against
        # the general ones (the default), at 43 layers: batch 1 windows alternating the fusions
        # (with the state reserved none should read slow or warn of a growth), batch 2 and 4, and
        # verify rounds of 1 + 1..4 rows; then the kernel table each way (2 and 4 rows).
        for caps in 1 0; do
            DSV4_ROW_CAPS=$caps timeout 200 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts '' \
                --reserve 4x4096 --decode-fill clone --decode-batches 1,2,4 --decode-context 4096 --decode-tokens 32 \
                --decode-fusions 1,0,1 --verify-drafts 1,2,3,4 > "$OUT/rowcaps-$caps.txt" 2>&1
            echo "flash q2 43 layers, DSV4_ROW_CAPS=$caps: exit $?" >> "$S"
            grep -E '^(decode batch.*ms|verify|warning)' "$OUT/rowcaps-$caps.txt" | cut -c1-150 >> "$S"
            DSV4_ROW_CAPS=$caps timeout 200 $B bench --backend cuda --synthetic kernels > "$OUT/kernels-caps$caps.txt" 2>&1
            echo "kernels, DSV4_ROW_CAPS=$caps: exit $?" >> "$S"
            grep -E '^ *int8 +[A-Za-z0-9_]+ +\[' "$OUT/kernels-caps$caps.txt" | cut -c1-120 >> "$S"
        done
        ;;
    attslices)
        # PERF.md v25: decode attention on attention_tc's key slices (fast mode below 32 rows,
        # DSV4_ATT_TC_SLICES=1) against the f32 kernel (the default) and against the slices' minimum
        # of 1 / 4 key tiles (kernel variants mint1 / mint4: `bash tools/device/variants.sh
        # mint1=sed:attention.cu:'s/define ATC_MINT 2/define ATC_MINT 1/' mint4=...`), 4 q2
        # layers at batches 1 and 16 (and sink1: hc.cu with one Sinkhorn iteration, a timing probe of
        # HC_PRE's long pole, wrong values); then the 43-layer step each way (batches 1 / 2 / 16, verify
        # 1 + 1..4, the DSpark round) and one 4-layer step's kernels (ncu).
        for bs in 1 16; do
            DSV4_ATT_TC_SLICES=1 LAYERS=4 BATCH=$bs bash tools/device/ab_step.sh DSV4_ATT_TC_SLICES=0 .devbin/kvar/mint1 \
                .devbin/kvar/mint4 .devbin/kvar/sink1 \
                > "$OUT/attslices-ab$bs.txt" 2>&1
            echo "4 q2 layers, batch $bs (builtin = slices, ATC_MINT 2; each variant with slices on but the first):" >> "$S"
            cat "$OUT/attslices-ab$bs.txt" >> "$S"
        done
        for sl in 1 0; do
            DSV4_ATT_TC_SLICES=$sl timeout 200 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts '' \
                --reserve 16x4096 --decode-fill clone --decode-batches 1,2,16 --decode-context 4096 --decode-tokens 32 \
                --verify-drafts 1,2,3,4 --dspark-round > "$OUT/attslices-$sl.txt" 2>&1
            echo "flash q2 43 layers, DSV4_ATT_TC_SLICES=$sl: exit $?" >> "$S"
            grep -E '^(decode batch.*ms|verify batch +1|dspark|warning)' "$OUT/attslices-$sl.txt" | cut -c1-150 >> "$S"
        done
        DSV4_ATT_TC_SLICES=1 CTX=4096 bash tools/device/profile.sh 4 q2 1 > /dev/null 2>&1
        sed -n '/^one step/,$p' "$OUT/ncu-q2-1.txt" | head -30 >> "$S"
        ;;
    l2pf)
        # PERF.md v25 lever 4: L2 prefetch blocks in the HC_PRE launch (DSV4_L2_PREFETCH=blocks:
        # the attention's wq_a / wkv / wq_b, then the router and the shared expert), 4 q2 layers
        # at batches 1 and 16 with 0 (builtin) / 16 / 32 / 64 blocks; then 43 layers with 0 and 32
        # and one 4-layer step's kernels with 32 (ncu: gemv1xg / gemv1x4 should shorten).
        for bs in 1 16; do
            LAYERS=4 BATCH=$bs bash tools/device/ab_step.sh DSV4_L2_PREFETCH=16 DSV4_L2_PREFETCH=32 DSV4_L2_PREFETCH=64 \
                > "$OUT/l2pf-ab$bs.txt" 2>&1
            echo "4 q2 layers, batch $bs (builtin = no prefetch):" >> "$S"
            cat "$OUT/l2pf-ab$bs.txt" >> "$S"
        done
        for pf in 32 0; do
            DSV4_L2_PREFETCH=$pf timeout 200 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts '' \
                --reserve 16x4096 --decode-fill clone --decode-batches 1,2,16 --decode-context 4096 --decode-tokens 32 \
                --verify-drafts 1,2,4 > "$OUT/l2pf-$pf.txt" 2>&1
            echo "flash q2 43 layers, DSV4_L2_PREFETCH=$pf: exit $?" >> "$S"
            grep -E '^(decode batch.*ms|verify batch +1|warning)' "$OUT/l2pf-$pf.txt" | cut -c1-150 >> "$S"
        done
        DSV4_L2_PREFETCH=32 CTX=4096 TAG=-l2pf bash tools/device/profile.sh 4 q2 1 > /dev/null 2>&1
        sed -n '/^one step/,$p' "$OUT/ncu-q2-1-l2pf.txt" | head -30 >> "$S"
        ;;
    pipe-tests)
        # PERF.md v26: the software-pipelined one-row int8 kernels (DSV4_X8_PIPE=E,G: chunks a
        # lane loads a batch in the experts' / the dense products' form, 0 = off; DSV4_X8_OPW:
        # outputs a warp) held to the same bits under four settings (odd batch counts with 3
        # outputs a warp in the down kernels): the int8 products against their CPU twin, one row's
        # experts against the separate launches and the several-row kernels; then the pipelined
        # bf16 decode product (DSV4_GEMVT_PIPE=1) against 16 rows' kernel.
        : > "$OUT/pipe-tests.txt"
        for cfg in "DSV4_X8_PIPE=4,4 DSV4_X8_OPW=4,4,8" "DSV4_X8_PIPE=1,1 DSV4_X8_OPW=2,2,2" \
            "DSV4_X8_PIPE=2,2 DSV4_X8_OPW=1,8,8" "DSV4_X8_PIPE=1,1 DSV4_X8_OPW=1,2,3"; do
            env $cfg RUST_BACKTRACE=1 timeout 200 .devbin/tests/cuda_packed --test-threads 1 int8 one_row \
                > /tmp/pipe-test.txt 2>&1
            echo "cuda_packed int8 / one_row with $cfg: exit $? $(grep -E '^test result' /tmp/pipe-test.txt | tail -1)" >> "$S"
            grep -E -A3 '^test .*FAILED|panicked' /tmp/pipe-test.txt | head -8 >> "$S"
            cat /tmp/pipe-test.txt >> "$OUT/pipe-tests.txt"
        done
        DSV4_GEMVT_PIPE=1 RUST_BACKTRACE=1 timeout 200 .devbin/tests/cuda_packed --test-threads 1 bf16 > /tmp/pipe-test.txt 2>&1
        echo "cuda_packed bf16 with DSV4_GEMVT_PIPE=1: exit $? $(grep -E '^test result' /tmp/pipe-test.txt | tail -1)" >> "$S"
        grep -E -A3 '^test .*FAILED|panicked' /tmp/pipe-test.txt | head -8 >> "$S"
        cat /tmp/pipe-test.txt >> "$OUT/pipe-tests.txt"
        ;;
    pipe)
        # PERF.md v26's A/B (after pipe-tests): 4 q2 layers at batch 1 with each setting (two
        # passes), then 43 layers with the fastest pass-2 setting (builtin included: then only
        # the builtin runs) and the builtin, and the winner's 4-layer step under ncu.
        V=("DSV4_X8_OPW=1,4,8+DSV4_X8_PIPE=2" "DSV4_X8_OPW=1,4,8+DSV4_X8_PIPE=4" "DSV4_X8_OPW=1,8,8+DSV4_X8_PIPE=2"
           "DSV4_X8_OPW=1,2,4+DSV4_X8_PIPE=2" "DSV4_X8_PIPE=0,2" "DSV4_X8_PIPE=0,4" "DSV4_X8_OPW=2,4,8+DSV4_X8_PIPE=2,2"
           "DSV4_GEMVT_PIPE=1" "DSV4_X8_OPW=1,4,8+DSV4_X8_PIPE=2,2+DSV4_GEMVT_PIPE=1")
        LAYERS=4 BATCH=1 bash tools/device/ab_step.sh "${V[@]}" > "$OUT/pipe-ab1.txt" 2>&1
        echo "4 q2 layers, batch 1 (builtin = load-then-decode, one output a warp but the two-launch experts 4 / 4 since v49):" >> "$S"
        cat "$OUT/pipe-ab1.txt" >> "$S"
        best=$(awk '$1 == "pass" && $2 == 2 && /ms\/step/ {
                   for (i = 1; i < NF; i++) if ($(i + 1) == "ms/step") { print $i, $3; break } }' "$OUT/pipe-ab1.txt" |
               sort -g | head -1 | cut -d' ' -f2)
        tags=off
        [ -n "$best" ] && [ "$best" != builtin ] && tags="best off"
        for tag in $tags; do
            v=$([ $tag = best ] && echo "$best" || echo DSV4_X8_PIPE=0)
            IFS='+' read -ra envs <<< "$v"
            env "${envs[@]}" timeout 200 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts '' \
                --reserve 16x4096 --decode-fill clone --decode-batches 1,2,16 --decode-context 4096 --decode-tokens 32 \
                --verify-drafts 1,2,4 > "$OUT/pipe-43-$tag.txt" 2>&1
            echo "flash q2 43 layers, $v: exit $?" >> "$S"
            grep -E '^(decode batch.*ms|verify batch +1|warning)' "$OUT/pipe-43-$tag.txt" | cut -c1-150 >> "$S"
        done
        # The winner's kernels one by one (ncu): did moe_up1s / moe_down1s / gemvt shorten?
        if [ "$tags" != off ]; then
            IFS='+' read -ra envs <<< "$best"
            env "${envs[@]}" CTX=4096 TAG=-pipe bash tools/device/profile.sh 4 q2 1 > /dev/null 2>&1
            echo "ncu, 4 q2 layers at context 4096, batch 1, with $best:" >> "$S"
            grep -E 'moe_up1s|moe_down1s|gemv1x|gemvt|gemv_route|one step' "$OUT/ncu-q2-1-pipe.txt" | head -16 >> "$S"
        fi
        ;;
    prof16)
        # Where a batch-16 step goes now (issue 11: 1,000 tok/s; last profiled in the eighth
        # session): one 4-layer step at context 4096 under ncu, with whatever defaults and
        # environment this build has.
        CTX=4096 TAG=-b16 bash tools/device/profile.sh 4 q2 16 > /dev/null 2>&1
        echo "ncu, 4 q2 layers at context 4096, batch 16:" >> "$S"
        sed -n '/^one step/,$p' "$OUT/ncu-q2-16-b16.txt" | head -30 >> "$S"
        ;;
    v28)
        # PERF.md v28's open questions on a build of its defaults (one selector copy, XT_CG 4, no
        # tile rounds), with kernel directories from variants.sh: sel8 / sel16 (`s/define
        # SEL_COPIES 1/define SEL_COPIES 8/`, 16), cg1 (`s/define XT_CG 4/define XT_CG 1/`):
        # sel8's bitwise checks, then the 4-layer A/Bs at batches 16 (three passes' worth: the
        # H100's spread was ±3 %) and 64. ~6 minutes.
        K=DSV4_CUDA_KERNELS=$PWD/.devbin/kvar
        t1 packed-sel8 $K/sel8 timeout 150 .devbin/tests/cuda_packed
        for b in 16 16; do
            echo "4 q2 layers, batch $b:" >> "$S"
            LAYERS=4 BATCH=$b bash tools/device/ab_step.sh .devbin/kvar/sel8 .devbin/kvar/sel16 .devbin/kvar/cg1 >> "$S" 2>&1
        done
        echo "4 q2 layers, batch 64:" >> "$S"
        EXTRA="--reserve 64x4096 --decode-fill clone" LAYERS=4 BATCH=64 bash tools/device/ab_step.sh .devbin/kvar/sel8 \
            DSV4_TILE_ROUNDS=8 >> "$S" 2>&1
        ;;
    v29)
        # PERF.md v29: the dense tiles' blocks an SM. One 4-layer batch-16 step under ncu with the
        # built-in kernels (U = 4 chunks ahead, 128 registers: 2 blocks of 8 warps an SM), xtu2
        # (U = 2, 90 registers: still 2) and xtu2w24 (U = 2 held to 80 registers: 3 blocks), from
        # `variants.sh "xtu2=sed:quant.cu:s/xtile<F, NT, 1, W, 4>(/xtile<F, NT, 1, W, 2>(/"
        # "xtu2w24=sed:quant.cu:s/xtile<F, NT, 1, W, 4>(/xtile<F, NT, 1, W, 2>(/;s/define
        # TILE_WARPS_SM 0/define TILE_WARPS_SM 24/"`: the gemvt lines of each.
        ncu_each 16 gemvt builtin xtu2 xtu2w24
        ;;
    v29cp)
        # PERF.md v29: the dense Q8_0 tiles on cp.async (gemvtc, DSV4_TILE_CP=1) against registers
        # (the default): the bitwise checks (cuda_packed runs both), one batch-16 step under ncu
        # each way (the gemvt lines), then the step A/B at batches 16 and 8.
        t1 packed timeout 200 .devbin/tests/cuda_packed
        t1 invariance timeout 100 .devbin/tests/cuda_invariance
        for cp in 1 0; do
            DSV4_TILE_CP=$cp CTX=4096 TAG=-cp$cp bash tools/device/profile.sh 4 q2 16 > /dev/null 2>&1
            echo "ncu, 4 q2 layers at context 4096, batch 16, DSV4_TILE_CP=$cp:" >> "$S"
            grep -E '^(gemvt|one step)' "$OUT/ncu-q2-16-cp$cp.txt" | head -8 >> "$S"
        done
        for b in 16 8; do
            echo "4 q2 layers, batch $b:" >> "$S"
            LAYERS=4 BATCH=$b bash tools/device/ab_step.sh DSV4_TILE_CP=1 >> "$S" 2>&1
        done
        ;;
    v30)
        # PERF.md v30: HC_PRE's apply at batch 1 (which block is its pole: sink1 runs one Sinkhorn
        # iteration, norm0 skips block 0's mix and norm; both timing probes with wrong values,
        # from `variants.sh`), then where the warps of hc_pre_apply_norm, moe_up1s (batch 1)
        # and moe_upx (batch 16) wait, instruction by instruction (ncu_source.sh).
        ncu_each 1 hc_ builtin sink1 norm0
        TAG=-hc BATCH=1 bash tools/device/ncu_source.sh hc_pre_apply_norm 4 1 > /dev/null 2>&1
        TAG=-up1s BATCH=1 bash tools/device/ncu_source.sh moe_up1s 4 1 > /dev/null 2>&1
        TAG=-upx BATCH=16 bash tools/device/ncu_source.sh moe_upx 4 1 > /dev/null 2>&1
        for t in 1-hc 1-up1s 16-upx; do head -12 "$OUT/source-$t.txt" >> "$S"; done
        ;;
    v30xs)
        # PERF.md v30: the several-row expert kernels with their activation rows staged in shared
        # memory (kernel directory xs from `variants.sh xs=patch:tools/device/patches/v30-xs.diff`,
        # measured slower and not kept): the bitwise checks, the experts' ncu lines at batch 16,
        # the step A/B at 16, 64, 8.
        t1 packed env DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/xs timeout 200 .devbin/tests/cuda_packed
        t1 invariance env DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/xs timeout 100 .devbin/tests/cuda_invariance
        ncu_each 16 moe_ builtin xs
        ab_each 16,64,8 .devbin/kvar/xs
        ;;
    v30pre)
        # PERF.md v30: moe_upx's table filled after its first weight loads (pre3: the loads'
        # DRAM trip before the table's L2 trip and barrier; pre2: the same with 2 blocks an SM,
        # no spills) and upb2 (2 blocks an SM alone), kernel directories from `variants.sh
        # V=patch:tools/device/patches/v30-V.diff` (none kept): pre2's bitwise checks, the
        # experts' ncu lines at batch 16, the step A/B at 16 and 64.
        t1 packed env DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/pre2 timeout 200 .devbin/tests/cuda_packed
        t1 invariance env DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/pre2 timeout 100 .devbin/tests/cuda_invariance
        ncu_each 16 moe_upx builtin upb2 pre3 pre2
        ab_each 16,64 .devbin/kvar/upb2 .devbin/kvar/pre3 .devbin/kvar/pre2
        ;;
    v30sink)
        # PERF.md v30: the Sinkhorn's dummy lanes divide 1, not 0 (kernel directory sinkfix: the
        # fix's hc.cu, `variants.sh sinkfix=<fix>:hc.cu`, beside binaries without it): the HC
        # checks, then batch 1's HC kernels under ncu and the step A/B at batches 1 and 16.
        t1 packed-hc env DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/sinkfix timeout 100 .devbin/tests/cuda_packed hc
        ncu_each 1 hc_pre_apply_norm builtin sinkfix
        ab_each 1,16 .devbin/kvar/sinkfix
        ;;
    srcall)
        # PERF.md "Next (after v30)" item 2: every kernel of one batch-1 step under ncu's source
        # counters (ncu_source.sh), a line each: slow-path calls and local memory executed.
        TAG=-all BATCH=${SRC_BATCH:-1} bash tools/device/ncu_source.sh . 4 120 > /dev/null 2>&1
        echo "ncu source counters, one batch-${SRC_BATCH:-1} step (kernel; calls; local memory):" >> "$S"
        grep -E '^== |^calls executed|^local memory executed' "$OUT/source-${SRC_BATCH:-1}-all.txt" | paste -d' ' - - - \
            | sed 's/== Kernel Name //' | sort | uniq -c | head -60 >> "$S"
        ;;
    b64ab)
        # PERF.md "Next (after v29)": batch 64's products on other paths, one 4-layer step each,
        # two passes: the dense products on the int8 tiles instead of prefill's bf16 pgemm64
        # (DSV4_X8_MAX_ROWS=64: 4 row tiles of 16 read each weight from L2 after the first) and
        # the routed experts on the int8 tiles too (DSV4_X8_TILES=all).
        echo "4 q2 layers, batch 64:" >> "$S"
        EXTRA="--reserve 64x4096 --decode-fill clone" LAYERS=4 BATCH=64 bash tools/device/ab_step.sh \
            DSV4_X8_MAX_ROWS=64 DSV4_X8_MAX_ROWS=64+DSV4_X8_TILES=all >> "$S" 2>&1
        ;;
    stalls)
        # Why the slow kernels of batches 16, 64 and 1 are slow (tools/device/ncu_stalls.sh), and
        # where a batch-64 step goes; most wanted first, each table into the summary as it comes
        # (a call may stop at its limit).
        BATCH=16 bash tools/device/ncu_stalls.sh 'moe_upx|moe_downx|gemvt28' 4 3 > /dev/null 2>&1
        cat "$OUT"/stalls-16.txt >> "$S" 2>/dev/null
        X64="--reserve 64x4096 --decode-fill clone"
        EXTRA=$X64 CTX=4096 TAG=-b64 bash tools/device/profile.sh 4 q2 64 > /dev/null 2>&1
        echo "ncu, 4 q2 layers at context 4096, batch 64:" >> "$S"
        sed -n '/^one step/,$p' "$OUT/ncu-q2-64-b64.txt" | head -24 >> "$S"
        EXTRA=$X64 BATCH=64 bash tools/device/ncu_stalls.sh 'moe_upx|moe_downx|gemvt|moe_upt|moe_downt' 4 4 > /dev/null 2>&1
        cat "$OUT"/stalls-64.txt >> "$S" 2>/dev/null
        BATCH=1 bash tools/device/ncu_stalls.sh 'moe_up1s|moe_down1s|gemv1x4|hc_pre_apply' 4 5 > /dev/null 2>&1
        cat "$OUT"/stalls-1.txt >> "$S" 2>/dev/null
        ;;
    hcprobe)
        # PERF.md v25 lever 2: hc_pre_apply_norm launched twice in a row (DSV4_PROBE_HC_TWICE=1;
        # it reads nothing it writes, so the values are unchanged): in one 4-layer step's ncu
        # launch order the first of each pair is the step's cold launch, the second runs with
        # the code and data just used. A much shorter second launch points at the instruction
        # cache (39 % of its stalls waited for an instruction fetch).
        DSV4_PROBE_HC_TWICE=1 CTX=4096 TAG=-hc2 bash tools/device/profile.sh 4 q2 1 > /dev/null 2>&1
        echo "hc_pre_apply_norm twice (cold, warm), 4 q2 layers at ctx 4096:" >> "$S"
        grep -E 'hc_pre_apply_norm|hc_pre_dot' "$OUT/ncu-q2-1-hc2.txt" | head -24 >> "$S"
        ;;
    flash-served)
        # The 43-layer q2 decode in the mode `dsv4 serve` runs by default (exact: f32 activations
        # into bf16 products), the figure bench_serve's rates compare with.
        # Batches 1 / 16 / 64, the levels bench_serve runs (issue 11: within 15 % of these).
        timeout 300 $B bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' --cuda-exact \
            --reserve 64x4096 --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 \
            > "$OUT/flash-served.txt" 2>&1
        echo "flash q2 $FL layers (serve's exact mode): exit $?" >> "$S"
        grep -E '^decode' "$OUT/flash-served.txt" | cut -c1-220 >> "$S"
        ;;
    flash-bf16)
        # Issue 11's bf16 figure: 4 Flash-dim layers, batch 1 (and 16), ctx 4096.
        timeout 240 $B bench --backend cuda --synthetic flash --layers 4 --weights bf16 --contexts '' \
            --decode-batches 1,16 --decode-context 4096 --decode-tokens 16 > "$OUT/flash-bf16.txt" 2>&1
        echo "flash bf16 4 layers: exit $?" >> "$S"
        grep -E '^decode' "$OUT/flash-bf16.txt" | cut -c1-220 >> "$S"
        ;;
    prefill)
        # Issue 12's figures: 43 q2 layers at 2K / 8K / 32K (chunks of 8192; 32K is the
        # time to first token of a ~30K prompt), bf16 4 layers at 1K / 4K (HF's comparison
        # shape), official FP8 + FP4 on 16 layers (extrapolated), and a 4-layer stage profile of
        # one 8K chunk (DSV4_PROFILE_PREFILL).
        P="bench --backend cuda --synthetic flash --prefill-chunk 8192 --decode-batches 1 --decode-context 16 --decode-tokens 1"
        timeout 200 $B $P --layers 43 --weights q2 --contexts 2048,8192,32768 > "$OUT/prefill-q2.txt" 2>&1
        echo "prefill q2 43 layers: exit $?" >> "$S"
        timeout 90 $B $P --layers 4 --weights bf16 --contexts 1024,4096,8192 > "$OUT/prefill-bf16.txt" 2>&1
        echo "prefill bf16 4 layers: exit $?" >> "$S"
        timeout 120 $B $P --layers 16 --weights official --contexts 8192 > "$OUT/prefill-official.txt" 2>&1
        echo "prefill official 16 layers: exit $?" >> "$S"
        grep -hE '^prefill' "$OUT"/prefill-q2.txt "$OUT"/prefill-bf16.txt "$OUT"/prefill-official.txt | cut -c1-200 >> "$S"
        DSV4_PROFILE_PREFILL=8192 timeout 90 $B $P --layers 4 --weights q2 --contexts '' > "$OUT/prefill-profile.txt" 2>&1
        echo "prefill stage profile (4 q2 layers, one 8K chunk): exit $?" >> "$S"
        sed -n '/^profile: one prefill/,/^{/p' "$OUT/prefill-profile.txt" | head -16 >> "$S"
        ;;
    hf)
        # Issue 12's side by side in one call: HF transformers 5.23's own prefill (the wheel
        # build.sh put in .devbin/wheels; the device image has 5.17) and dsv4's, 4 bf16 Flash
        # layers at 1K and 4K.
        W=$(ls .devbin/wheels/transformers-5.23.0-*.whl 2>/dev/null | head -1)
        [ -n "$W" ] && python3 -m pip install -q --no-deps --target /tmp/hf523 "$W" > /dev/null 2>&1
        PYTHONPATH=/tmp/hf523 timeout 400 python3 tools/hf_prefill_bench.py --lengths 1024,4096 > "$OUT/hf.txt" 2>&1
        echo "hf prefill: exit $?" >> "$S"
        grep -E '^(hf|warning)' "$OUT/hf.txt" >> "$S"
        timeout 90 $B bench --backend cuda --synthetic flash --layers 4 --weights bf16 --contexts 1024,4096 \
            --prefill-chunk 8192 --decode-batches 1 --decode-context 16 --decode-tokens 1 > "$OUT/dsv4-bf16.txt" 2>&1
        echo "dsv4 prefill bf16 4 layers: exit $?" >> "$S"
        grep -E '^prefill' "$OUT/dsv4-bf16.txt" | cut -c1-200 >> "$S"
        ;;
    serve)
        # bench_serve on the 43-layer q2 model at 1 / 16 / 64 (serve's default, exact mode: compare
        # with flash-served), with the engine's per-step split (forward, plan, snapshots).
        # Each snapshot's phases (cuda/state.rs: download vs host ms) from the server's log.
        rm -f /tmp/dsv4-serve-*.log
        RUST_LOG=info,dsv4_backend::cuda::state=debug timeout 420 python3 -u tools/bench_serve.py --spawn $B \
            --backend cuda --concurrency ${SERVE_LEVELS:-1,16,64} --max-tokens 64 ${SERVE_BENCH:-} \
            --extra "--synthetic-flash-layers $FL --synthetic-flash-weights q2 --max-context 4096 ${SERVE_EXTRA:-}" > "$OUT/serve.txt" 2>&1
        echo "serve q2 $FL layers ${SERVE_EXTRA:-} ${SERVE_BENCH:-}: exit $?" >> "$S"
        grep -E '^\{' "$OUT/serve.txt" | cut -c1-900 >> "$S"
        grep -h 'snapshot of' /tmp/dsv4-serve-*.log > "$OUT/serve-snapshots.txt" 2>/dev/null
        awk '{for (i = 1; i < NF; i++) { if ($i == "download") d += $(i + 1); if ($i == "host") h += $(i + 1) } n++}
             END { if (n) printf "snapshots: %d, mean download %.2f ms, host %.2f ms\n", n, d / n, h / n }' \
            "$OUT/serve-snapshots.txt" >> "$S"
        # The engine thread's part of each snapshot (save_begin) and the staging buffers page-locked.
        grep -h 'snapshot queued\|snapshot staging' /tmp/dsv4-serve-*.log > "$OUT/serve-queue.txt" 2>/dev/null
        awk '/queued/ {q += $(NF - 1); n++} /page-locked/ {p += $(NF - 1); m++}
             END { printf "engine side: %d snapshots queued, mean %.2f ms; %d staging buffers page-locked, mean %.2f ms\n", n, n ? q / n : 0, m, m ? p / m : 0 }' \
            "$OUT/serve-queue.txt" >> "$S"
        grep -h 'snapshot queued' "$OUT/serve-queue.txt" | awk '{print $(NF-1)}' | sort -n | awk '{a[NR]=$1}
            END {print "queued ms: n",NR,"p50",a[int(NR*0.5)],"p90",a[int(NR*0.9)],"p99",a[int(NR*0.99)],"max",a[NR]}' >> "$S"
        # Snapshots that found no staging buffer when begun, and how their halves copied.
        echo "no staging buffer at begin: $(grep -ch 'no staging' "$OUT/serve-queue.txt");" \
            "staged after a wait: $(grep -ch 'staged after a wait' "$OUT/serve-snapshots.txt");" \
            "pageable: $(grep -ch 'pageable' "$OUT/serve-snapshots.txt")" >> "$S"
        grep -h 'staged after a wait' "$OUT/serve-snapshots.txt" | sed 's/.*, \([0-9.]*\) ms of it waiting.*/\1/' | sort -n \
            | awk '{a[NR]=$1} END {if (NR) print "waited ms: p50",a[int(NR*0.5)+1],"max",a[NR]}' >> "$S"
        ;;
    *) echo "unknown part $part" >> "$S" ;;
    esac
done
cat "$S"
