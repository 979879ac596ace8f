#!/usr/bin/env python3
"""The last forward's kernels from an ncu run of a decode bench (no GPU needed to read it).

    ncu --graph-profiling node --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --print-units base \\
        dsv4 bench --backend cuda --synthetic flash ... --decode-tokens 1 > run.csv
    python3 tools/ncu_step.py run.csv [LAYERS]
    python3 tools/ncu_step.py --all run.csv   (every captured kernel: a DSpark draft, say)

A forward starts with `hc_expand` (the embedding's spread over the mHC streams), so the kernels
from the last `hc_expand` on are the last decode step. Prints them in launch order and then by
name (launches and time, sorted), the total, and the launches a layer when LAYERS is given.
ncu runs each kernel alone (serialised; with warm caches and real clocks by the flags above),
so the times rank kernels and say what each costs; the replayed step's time is the bench's.
"""
import csv
import sys
from collections import defaultdict

UNIT = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def kernels(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    out = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(row["Metric Value"].replace(",", "")) * UNIT.get(row.get("Metric Unit", "nsecond"), 1e-3)
        out.append((row["Kernel Name"].split("(")[0], v))
    return out


def main():
    args = sys.argv[1:]
    every = "--all" in args
    args = [a for a in args if a != "--all"]
    ks = kernels(args[0])
    layers = int(args[1]) if len(args) > 1 else 0
    starts = [i for i, (n, _) in enumerate(ks) if n == "hc_expand"]
    if not starts and not every:
        sys.exit("no hc_expand kernel: not a forward")
    step = ks if every else ks[starts[-1]:]
    print("launch order (us):")
    for n, v in step:
        print(f"  {v:8.1f}  {n[:70]}")
    count, total = defaultdict(int), defaultdict(float)
    for n, v in step:
        count[n] += 1
        total[n] += v
    tot = sum(total.values())
    print(f"one step: {len(step)} launches, {tot:.1f} us of kernel time (ncu, serialised)")
    if layers:
        print(f"launches a layer: {len(step) / layers:.1f} (head and embedding included)")
    print(f"{'kernel':<44} {'launches':>8} {'us':>9} {'share':>6}")
    for n in sorted(total, key=total.get, reverse=True):
        print(f"{n[:44]:<44} {count[n]:8d} {total[n]:9.1f} {100 * total[n] / max(tot, 1e-9):5.1f}%")


if __name__ == "__main__":
    main()
