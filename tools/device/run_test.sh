# Sourced by the device call scripts from the repository root: unpacks the carried binaries
# (devbin.tar.xz, always: a warm machine keeps an older .devbin), sets $OUT and the summary $S,
# and defines run_test.
tar -xJf devbin.tar.xz
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
# PTX compiled here by keep_ptx.sh (NVRTC 13.0): loaded instead of compiled where it matches.
[ -d .devbin/ptx ] && export DSV4_KERNEL_CACHE=$PWD/.devbin/ptx
S=$OUT/summary.txt
# `run_test BINARY [FILTER...]` runs .devbin/tests/BINARY
# (one thread, 150 s at most) into $OUT/test-BINARY.txt and appends its result and any failure
# to the summary $S.
run_test() {
  local t=$1; shift
  timeout 150 .devbin/tests/$t --test-threads 1 "$@" > "$OUT/test-$t.txt" 2>&1
  echo "test $t $*: exit $? $(grep -E '^test result' "$OUT/test-$t.txt" | tail -1)" >> "$S"
  grep -E -A3 '^test .*FAILED|panicked' "$OUT/test-$t.txt" | head -12 >> "$S"
}
# The device's name, then the device draw against its CPU twin (`cuda_backend
# cuda_draws_match_the_cpu_twin`), into the summary: the start of the sampling calls.
draw_twin_check() {
  nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
  run_test cuda_backend cuda_draws_match_the_cpu_twin --nocapture
  grep -E 'draw_rows|rows drawn' "$OUT/test-cuda_backend.txt" >> "$S"
}
# `experts_table NAME [VAR=VALUE...]`: the kernel bench's experts table (PERF.md v44; TABLES
# picks others: onerow, the one-row attention products, and stages, v48) under that environment into
# $OUT/experts-NAME.txt, its lines into the summary.
experts_table() {
  local v=$1 t0; shift
  t0=$(date +%s)
  env "$@" timeout 100 .devbin/dsv4 bench --backend cuda --synthetic kernels --tables "${TABLES:-experts}" \
      > "$OUT/experts-$v.txt" 2>&1
  echo "== $v ($*): exit $? in $(( $(date +%s) - t0 )) s" >> "$S"
  grep -E '^(experts|one row|stages)|rror' "$OUT/experts-$v.txt" | cut -c1-250 >> "$S"
}
# `batch1_rounds LAYERS NAME [VAR=VALUE...]`: a batch-1 decode step, verify 1+1..1+3 and the
# DSpark rounds on LAYERS q2 layers at context 4096 under that environment (into
# $OUT/ab-NAME.txt), their lines into the summary.
batch1_rounds() {
  local l=$1 v=$2; shift 2
  env "$@" timeout 80 .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$l" --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3 --dspark-round > "$OUT/ab-$v.txt" 2>&1
  echo "== $l layers, $v ($*): exit $?" >> "$S"
  grep -E '^(decode batch +1 at|verify|dspark batch +1(: draft|, measured))' "$OUT/ab-$v.txt" \
    | sed -E 's/ = [0-9.]+x a decode.*//; s/ +[0-9.]+ ms\/layer.*//' | cut -c1-170 >> "$S"
}
# `batches_16_64 LAYERS`: decode steps of 16 and 64 rows (cloned contexts of 4096) on LAYERS q2
# layers into $OUT/b1664.txt, their lines into the summary.
batches_16_64() {
  timeout 100 .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$1" --weights q2 --contexts '' \
      --reserve 64x4096 --decode-fill clone --decode-batches 16,64 --decode-context 4096 --decode-tokens 16 \
      > "$OUT/b1664.txt" 2>&1
  echo "== $1 layers, batches 16 and 64: exit $?" >> "$S"
  grep -E '^decode batch' "$OUT/b1664.txt" | cut -c1-150 >> "$S"
}
# `variant_env NAME`: the environment of a named kernel variant: base, base2: none (the built-in
# kernels: since v49 the two-launch experts at 4 / 4 outputs a warp, moe_down1s bounded to 2
# blocks an SM); old: every one-row kernel at 1 (the default before v49); dn5bp: kvar/dn5b with
# DSV4_DOWN1_PAIRS=1; dnp and the outputs-a-warp forms (upN: moe_up1s N outputs a warp, dnN:
# moe_down1s, both expert forms; up2p with X8_PIPE; gemv4: the one-row dense products 4 outputs a
# warp, so wo_a's block writes a whole 32-value group, with the default's experts). moe_down1s
# at 2 / 4 outputs is bounded to 3 / 2 blocks an SM by quant.cu since v49, so dnN are the v48
# forms dnNbM (kvar/dnb3 / dnb2 held those bounds) and no longer the unbounded ones. The
# launcher's settings (`keep_ptx.sh 'DSV4_X8_OPW=…'` keeps their PTX); att16: the decode slices on
# blocks of 16 heads (attention_tcd, v49; the built-in since v50, so att16 runs the built-in on
# binaries from v50 on); atmw16: att16 with kvar/atmw (attention_merge's statistics a lane a
# slice, the built-in since v50); att64: the slices on 64 heads a block (the form before v50);
# any other: kvar/NAME (v50's atm0: attention.cu with ATM_WARP 0; rt0: common.cuh with route_row
# before its register form, v51, reverted since; tkns: attention.cu with TOPK_SORT 0, v51, the
# fast-mode default since; cpf: attention.cu with CP_FAST 1, the default since v51; cp0: with
# CP_FAST 0; v52's stage0: quant.cu with X8_STAGE 0, the experts' rows in registers, and
# DSV4_FFN1_ROWS then 1 by default).
variant_env() {
  case $1 in
    base|base2) ;;
    old) echo DSV4_X8_OPW=1,1,1 ;;
    dn5bp) echo DSV4_DOWN1_PAIRS=1 DSV4_CUDA_KERNELS=.devbin/kvar/dn5b ;;
    dnp) echo DSV4_DOWN1_PAIRS=1 ;;
    up2) echo DSV4_X8_OPW=1,2,1 ;;
    up4) echo DSV4_X8_OPW=1,4,1 ;;
    up2p) echo DSV4_X8_OPW=1,2,1 DSV4_X8_PIPE=2 ;;
    dn2|dn2b3) echo DSV4_X8_OPW=1,1,2 ;;
    dn4|dn4b2) echo DSV4_X8_OPW=1,1,4 ;;
    up2dn2) echo DSV4_X8_OPW=1,2,2 ;;
    up4dn2|up4dn2b3) echo DSV4_X8_OPW=1,4,2 ;;
    up4dn4|up4dn4b2) echo DSV4_X8_OPW=1,4,4 ;;
    gemv4) echo DSV4_X8_OPW=4,1,1,1,4,4 ;;
    att16) echo DSV4_ATT_TC_HEADS=16 ;;
    atmw16) echo DSV4_ATT_TC_HEADS=16 DSV4_CUDA_KERNELS=.devbin/kvar/atmw ;;
    att64) echo DSV4_ATT_TC_HEADS=64 ;;
    *) echo DSV4_CUDA_KERNELS=.devbin/kvar/$1 ;;
  esac
}
# `experts_variants T0 NAME...`: the experts table for each named variant (`variant_env`) while
# fewer than ${BUDGET:-500} seconds have passed since T0.
experts_variants() {
  local t0=$1 v; shift
  for v in "$@"; do
    [ $(( $(date +%s) - t0 )) -lt ${BUDGET:-500} ] || break
    # shellcheck disable=SC2046  # the settings split into words on purpose
    experts_table $v $(variant_env $v)
  done
}
# `step1 NAME [VAR=VALUE...]`: batch-1 decode steps alone on $FL q2 layers at context 4096 under
# that environment (into $OUT/step1-NAME.txt), their lines into the summary.
step1() {
  local v=$1; shift
  env "$@" timeout 90 .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$FL" --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 32 \
      > "$OUT/step1-$v.txt" 2>&1
  echo "== $v ($*): exit $?" >> "$S"
  grep -E '^decode batch' "$OUT/step1-$v.txt" | cut -c1-150 >> "$S"
}
# `call_start DEFAULT`: the device's name into the summary; FL, the layers a 43-layer figure
# fits in (32 on an H100); T0, the call's start; and `t`, which notes the elapsed time in the
# summary and is true while fewer than LIMIT (else DEFAULT) seconds have passed since T0.
call_start() {
  G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
  FL=43; case "$G" in *H100*) FL=32 ;; esac
  T0=$(date +%s)
  LIMIT=${LIMIT:-$1}
}
t() { echo "at $(( $(date +%s) - T0 )) s" >> "$S"; [ $(( $(date +%s) - T0 )) -lt "$LIMIT" ]; }
# `experts_best NAME...`: the (at most two) named variants whose experts table's one-row DRAM
# figure beats the built-in's (the lower of base / base2) by more than 1 µs, best first, on
# stdout; the line into the summary.
experts_best() {
  local v f b best
  fig() { grep -E '^experts 1 rows, dram' "$OUT/experts-$1.txt" 2>/dev/null | grep -m1 -oE '[0-9.]+ µs a call' | cut -d' ' -f1; }
  b=$( (fig base; fig base2) | sort -n | head -1)
  best=$(for v in "$@"; do f=$(fig $v); [ -n "$f" ] && [ -n "$b" ] \
    && awk -v f="$f" -v b="$b" 'BEGIN{exit !(f < b - 1)}' && echo "$f $v"; done | sort -n | head -2 | cut -d' ' -f2 | tr '\n' ' ')
  echo "beat base ($b µs) by > 1 µs: ${best:-none}" >> "$S"
  echo $best
}
# `ab_variants NAME...`: batch 1 on $FL layers alternating the built-in kernels and the named
# variants, twice, then the first one's two-launch bitwise check, while `t` holds.
ab_variants() {
  local v
  # shellcheck disable=SC2046  # the settings split into words on purpose
  for v in base "$@" base "$@"; do t && batch1_rounds $FL $v-$(date +%s) $(variant_env $v); done
  if t; then
    # shellcheck disable=SC2046
    env $(variant_env $1) timeout 150 .devbin/tests/cuda_packed --test-threads 1 \
      cuda_one_row_experts_in_two_launches_are_bitwise > "$OUT/test-packed-$1.txt" 2>&1
    echo "cuda_packed two-launch test with $1: exit $?" >> "$S"
  fi
}
