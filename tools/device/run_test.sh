# Sourced by the device call scripts from the repository root: unpacks the carried binaries
# (devbin.tar.xz, always: a warm machine keeps an older .devbin), sets $OUT and the summary $S,
# and defines run_test.
tar -xJf devbin.tar.xz
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
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
