#!/usr/bin/env bash
# Twenty-seventh session, H200: the deferred-snapshot test (db8e5cb's pool refactor), then
# serving 43 q2 layers (run.sh serve: tok/s at 1 / 16 / 64, the engine-side snapshot stats).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
run_test cuda_snapshot deferred
bash tools/device/run.sh serve
