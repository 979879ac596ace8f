#!/usr/bin/env bash
# Twenty-seventh session: every 43-layer figure of issue 11's acceptance at the binaries' commit,
# fast and exact mode (run.sh issue11; an H200: 43 q2 layers hold 86.9 GB).
set -uo pipefail
cd "$(dirname "$0")/../.."
tar -xJf devbin.tar.xz
bash tools/device/run.sh issue11
