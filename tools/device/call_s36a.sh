#!/usr/bin/env bash
# Prepared in the thirty-fifth session (PERF.md v44) for the next device call, any GPU: the
# session's kernel changes checked (moe_down1s's slot products, the __grid_constant__ L2Ranges),
# then the experts table (behind queued GPU work) on the built-in kernels and the one-row expert
# variants, while the call has time (each process ~60 s).
#   run(command: "bash tools/device/call_s36a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
T0=$(date +%s)
run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
run_test cuda_packed cuda_int8_products_match_the_twin
run_test cuda_backend
experts_variants $T0 base up4b xa dn5bp pf512 sel16
cat "$S"
