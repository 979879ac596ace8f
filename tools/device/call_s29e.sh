#!/usr/bin/env bash
# Twenty-ninth session: serving sampled requests. bench_serve on FLASH_LAYERS q2 layers at
# SERVE_LEVELS, greedy, then sampled (T 0.8, top-p 0.95, a seed a request) drawn on the device,
# then the same drawn on the host (`serve --host-sampling`, the path before eb40a95).
set -uo pipefail
cd "$(dirname "$0")/../.."
tar -xJf devbin.tar.xz
export FLASH_LAYERS=${FLASH_LAYERS:-4} SERVE_LEVELS=${SERVE_LEVELS:-1,16,64}
bash tools/device/run.sh serve
SERVE_BENCH="--temperature 0.8 --top-p 0.95" bash tools/device/run.sh serve
SERVE_BENCH="--temperature 0.8 --top-p 0.95" SERVE_EXTRA=--host-sampling bash tools/device/run.sh serve
python3 - <<'PY'
import os, re
# The summary's JSON lines are cut at 900 characters: read the fields by pattern.
f = lambda pat, l: (re.search(pat, l) or [None, "-"])[1]
print("conc  tok/s  itl_p50  forward / step / wall ms  differs")
for l in open(os.environ.get("OUT", "/tmp/dsv4-out") + "/summary.txt"):
    if l.startswith("{"):
        print(f(r'"concurrency": (\d+)', l), f(r'"tokens_per_s": ([\d.]+)', l), f(r'"itl_ms": \{"50": ([\d.]+)', l),
              f(r'"forward": ([\d.]+)', l), f(r'"step": ([\d.]+)', l), f(r'"wall": ([\d.]+)', l),
              f(r'"differs_from_first_level": (\d+)', l))
PY
grep -E "^serve" "${OUT:-/tmp/dsv4-out}/summary.txt"
