#!/usr/bin/env python3
"""A summary of `ncu --page source --csv --print-source sass` (tools/device/ncu_source.sh).

For each kernel block in the CSV: the instructions executed and warp-state samples in all, the
samples by opcode, the stall-reason columns' totals, and the 30 instructions with the most
samples (address, opcode and operands, samples, executions): where the kernel's warps wait.
"""
import csv
import sys
from collections import Counter


def num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return None


def blocks(rows):
    """Splits the rows into (title, header, data) at each header row (one a kernel)."""
    out, title, head, data = [], "", None, []
    for r in rows:
        if any(c in ("Address", "# Address") for c in r) and "Source" in r:
            if head is not None:
                out.append((title, head, data))
            head, data = r, []
        elif head is None or len(r) != len(head):
            if r and head is not None and data:
                out.append((title, head, data))
                head, data = None, []
            title = " ".join(c for c in r if c)[:160] or title
        else:
            data.append(r)
    if head is not None:
        out.append((title, head, data))
    return out


def pick(head, *keys):
    for k in keys:
        for i, h in enumerate(head):
            if h.lower() == k.lower():
                return i
    for k in keys:
        for i, h in enumerate(head):
            if k.lower() in h.lower():
                return i
    return None


def main(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for title, head, data in blocks(rows):
        src = pick(head, "Source")
        samp = pick(head, "Warp Stall Sampling (All Samples)", "Sampling Data (All)", "stall_sampling")
        exe = pick(head, "Instructions Executed", "inst_executed")
        addr = pick(head, "Address", "# Address")
        reasons = [i for i, h in enumerate(head) if h.startswith("stall_") or "Stall" in h and i not in (samp,)]
        print(f"== {title}")
        print(f"columns: {len(head)}; rows: {len(data)}; samples column: {head[samp] if samp is not None else None}")
        tot = sum(num(r[samp]) or 0 for r in data) if samp is not None else 0
        # What v30 found by hand: slow-path calls taken (CALL.REL executed) and local memory
        # (spills, indexed arrays) executed, with their samples.
        for tag, ops in (("calls executed", ("CALL",)), ("local memory executed", ("STL", "LDL"))):
            hits = [r for r in data
                    if any(o in r[src].split()[:2] for o in ops) or any(t.startswith(ops) for t in r[src].split()[:2])]
            n = sum((num(r[exe]) or 0) for r in hits) if exe is not None else 0
            smp = sum((num(r[samp]) or 0) for r in hits) if samp is not None else 0
            print(f"{tag}: {n:.0f} warp instructions, {smp:.0f} samples ({smp / max(tot, 1):.1%} of the samples)")
        if samp is None:
            print("  headers:", ", ".join(head[:60]))
            continue
        tex = sum(num(r[exe]) or 0 for r in data) if exe is not None else 0
        print(f"samples {tot:.0f}, warp instructions executed {tex:.0f}")
        by_op = Counter()
        for r in data:
            op = r[src].split()[0] if r[src].split() else "?"
            if op.startswith("@"):
                op = r[src].split()[1] if len(r[src].split()) > 1 else op
            by_op[op.split(".")[0]] += num(r[samp]) or 0
        print("samples by opcode:", ", ".join(f"{o} {v / max(tot, 1):.1%}" for o, v in by_op.most_common(14)))
        rs = Counter()
        for i in reasons:
            rs[head[i]] = sum(num(r[i]) or 0 for r in data)
        if rs:
            print("by reason:", ", ".join(f"{k} {v:.0f}" for k, v in rs.most_common(10)))
        top = sorted(data, key=lambda r: -(num(r[samp]) or 0))[:30]
        for r in top:
            print(f"  {r[addr] if addr is not None else '':>8} {num(r[samp]) or 0:7.0f} "
                  f"{(num(r[exe]) or 0) if exe is not None else 0:9.0f}  {r[src][:90]}")


if __name__ == "__main__":
    main(sys.argv[1])
