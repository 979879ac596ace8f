#!/usr/bin/env python3
"""A short table a launch from `ncu --page raw --csv --print-units base` (tools/device/ncu_stalls.sh).

Per launch: name, grid, duration, DRAM and issue-slot use, achieved occupancy, registers, shared
memory wavefronts and the share of them from bank conflicts, then the largest stall reasons in
cycles a warp between two of its issues (ncu's `smsp__average_warps_issue_stalled_*` ratios).
"""
import csv
import sys


def num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return None


def main(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # The header row holds the metric names; the row after it their units (skipped).
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names = rows[head]
    col = {n: i for i, n in enumerate(names)}
    data = [r for r in rows[head + 2 :] if len(r) == len(names)]

    def get(r, *keys):
        for k in keys:
            if k in col:
                v = num(r[col[k]])
                if v is not None:
                    return v
        return None

    stall_cols = [
        n
        for n in names
        if n.startswith("smsp__average_warps_issue_stalled_") and n.endswith("_per_issue_active.ratio")
    ]
    for r in data:
        name = r[col["Kernel Name"]].split("(")[0]
        grid = r[col["Grid Size"]] if "Grid Size" in col else "?"
        block = r[col["Block Size"]] if "Block Size" in col else "?"
        dur = get(r, "gpu__time_duration.sum")
        dram = get(r, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
        issue = get(r, "sm__inst_issued.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active")
        occ = get(r, "sm__warps_active.avg.pct_of_peak_sustained_active")
        regs = get(r, "launch__registers_per_thread")
        elig = get(r, "smsp__warps_eligible.avg.per_cycle_active")
        cyc = get(r, "smsp__average_warp_latency_per_inst_issued.ratio")
        wav = get(r, "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum")
        conf = get(r, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")
        inst = get(r, "smsp__inst_executed.sum")
        sm_act = get(r, "sm__cycles_active.avg")
        sm_el = get(r, "sm__cycles_elapsed.avg")
        fmt = lambda v, f="{:.1f}": "?" if v is None else f.format(v)
        print(
            f"{name} grid {grid} block {block}: {fmt(dur / 1e3 if dur else None)} us, DRAM {fmt(dram)} %, "
            f"issue {fmt(issue)} %, occupancy {fmt(occ)} %, {fmt(regs, '{:.0f}')} regs, eligible {fmt(elig, '{:.2f}')}"
            f"/sched, {fmt(cyc)} cycles between issues, {fmt(inst / 1e6 if inst else None, '{:.2f}')} M warp inst, "
            f"SM active {fmt(100 * sm_act / sm_el if sm_act and sm_el else None)} %"
        )
        if wav:
            print(f"    shared wavefronts {wav / 1e6:.2f} M, bank conflicts {100 * (conf or 0) / wav:.0f} %")
        st = []
        for n in stall_cols:
            v = num(r[col[n]])
            if v:
                st.append((v, n[len("smsp__average_warps_issue_stalled_") : -len("_per_issue_active.ratio")]))
        st.sort(reverse=True)
        print("    stalls: " + ", ".join(f"{k} {v:.2f}" for v, k in st[:7]))


if __name__ == "__main__":
    main(sys.argv[1])
