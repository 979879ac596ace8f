#!/usr/bin/env bash
# The kernel bench on the built-in kernels and on each variant directory (DSV4_CUDA_KERNELS:
# .cu files replacing the built-in ones, same launch signatures), one table per variant:
#   run(command: "bash tools/device/ab.sh .devbin/kvar/v9 ...", carry: [".devbin"])
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
A=$OUT/ab.txt
for v in builtin "$@"; do
    echo "==== $v" >> "$A"
    if [ "$v" = builtin ]; then
        timeout 200 .devbin/dsv4 bench --backend cuda --synthetic kernels > /tmp/ab.txt 2>&1
    else
        DSV4_CUDA_KERNELS=$PWD/$v timeout 200 .devbin/dsv4 bench --backend cuda --synthetic kernels > /tmp/ab.txt 2>&1
    fi
    echo "exit $?" >> "$A"
    grep -E '^ *(int8 +)?[A-Za-z0-9_]+ +\[' /tmp/ab.txt | sed -E 's/ +err [^:]*:|  vs twin [^:]*://; s/ GB\/s \( *[0-9]+%\)//g; s/ rows//g' >> "$A"
    grep -iE 'error|panick' /tmp/ab.txt | head -5 >> "$A"
done
cat "$A"
