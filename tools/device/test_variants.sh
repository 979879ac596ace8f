#!/usr/bin/env bash
# On the device: one CUDA test binary on the built-in kernels and on each variant directory
# (tools/device/variants.sh), a result line each:
#   run(command: "bash tools/device/test_variants.sh cuda_gguf .devbin/kvar/pre-v9 ...", carry: [".devbin"])
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
export DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/crates/dsv4-dspark/tests/fixtures DSV4_BIN=$PWD/.devbin/dsv4
t=$1
shift
for v in builtin "$@"; do
    if [ "$v" = builtin ]; then unset DSV4_CUDA_KERNELS; else export DSV4_CUDA_KERNELS=$PWD/$v; fi
    timeout 300 ".devbin/tests/$t" --test-threads 1 --nocapture > "$OUT/$t-$(basename "$v").txt" 2>&1
    echo "$t [$v]: exit $? $(grep -E '^test result' "$OUT/$t-$(basename "$v").txt" | tail -1)"
    grep -E 'worst relative|panicked|FAILED' "$OUT/$t-$(basename "$v").txt" | head -8
done
