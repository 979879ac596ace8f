#!/usr/bin/env python3
"""Host emulation of gemm.cu's pg_tile_w shared-memory addressing (no GPU needed).

Checks, for both stages, both warpgroups' A descriptors and the B descriptor, every k16 step:
  1. the threads' 16-byte stores (pg_tile_w's `so` + 32·128·i, cp.async and st.shared alike)
     put element (row, k) exactly where wgmma reads it, the read address computed from the
     64-bit descriptor the kernel builds (wg_desc + the stage/step offset), decoded with the PTX
     ISA's field layout and its K-major 128-byte-swizzle canonical layout
     Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T)), T = 8 bf16, on byte addresses;
  2. the stores cover each stage's 16 KB once (no overlap), inside PGW_SMEM, and each 8-thread phase of a warp's
     16-byte stores hits 8 distinct 16-byte bank groups (conflict-free);
  3. an end-to-end product: A (128 × 64) and B (128 × 64) stored as the threads store them, D
     computed by reading through the descriptors, each thread's accumulator registers mapped to
     (row, column) as pg_tile_w's epilogue maps them (the ISA's m64nNk16 D-fragment layout), equal
     to A·Bᵀ.
Run: python3 tools/sass/wgmma_swizzle.py (exit status 1 on any mismatch).
"""
import random
import sys

PG_BK, PG_BN, BM = 64, 128, 128
CPR, RP = PG_BK // 8, 256 // (PG_BK // 8)
XS, WS = BM // RP, PG_BN // RP
STAGE = 128 * 128  # PGW_STAGE: bytes of one stage of A or B
PGW_SMEM = 4 * STAGE + 1024  # gemm.rs: the launch's dynamic shared memory


def wg_desc(a):  # gemm.cu's wg_desc
    return ((a & 0x3FFFF) >> 4) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


def desc_read(desc, i, j):
    """Byte address wgmma reads for element (row i, k j) of a K-major bf16 operand (k j < 16)."""
    start = (desc & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    base_off = (desc >> 49) & 7
    mode = desc >> 62
    assert mode == 1 and base_off == 0, "128B swizzle, patterns at 1024-byte boundaries"
    T = 8  # bf16 elements in 16 bytes
    i0, i1, j0, j1 = i % 8, i // 8, j % T, j // T
    addr = start + 2 * (i0 * 8 * T + j0 + j1 * T) + i1 * sbo  # LBO unused (swizzled K-major)
    return addr ^ (((addr >> 7) & 7) << 4)  # Swizzle<3,4,3> on the byte address


def stores(base, buf, operand):
    """{byte address: (row, k)} of every bf16 the 256 threads store into one stage, and per
    warp the 16-byte store addresses in issue order [(i, [address of lane 0..31])]."""
    out, phases = {}, []
    stage = base + (buf if operand == "A" else 2 + buf) * STAGE
    for i in range(XS if operand == "A" else WS):
        lanes = {}
        for tid in range(256):
            lr, c = tid // CPR, tid % CPR
            so = lr * 128 + ((c ^ (lr & 7)) << 4)
            a = stage + so + RP * 128 * i
            row, k0 = lr + RP * i, 8 * c
            lanes.setdefault(tid // 32, []).append(a)
            for e in range(8):
                assert a + 2 * e not in out, "two stores to one address"
                out[a + 2 * e] = (row, k0 + e)
        phases.append(lanes)
    return out, phases


def main():
    bad = checked = 0
    for raw in (0, 16, 2560 + 48, 3584):  # dynamic shared start after various static arrays
        base = (raw + 1023) & ~1023
        for buf in (0, 1):
            for op in ("A", "B"):
                st, phases = stores(base, buf, op)
                assert len(st) == STAGE // 2, "a stage covered once"
                assert raw <= min(st) and max(st) < raw + PGW_SMEM, "inside the dynamic shared memory"
                for lanes in phases:
                    for w, addrs in lanes.items():
                        for p in range(4):  # a 16-byte store: 4 phases of 8 lanes
                            groups = {(a >> 4) & 7 for a in addrs[8 * p:8 * p + 8]}
                            if len(groups) != 8:
                                bad += 1
                ops = [(wg, wg_desc(base + wg * 64 * 128), 64) for wg in (0, 1)] if op == "A" else [
                    (0, wg_desc(base + 2 * STAGE), 128)]
                for wg, d0, rows in ops:
                    for kk in range(PG_BK // 16):
                        d = d0 + ((buf * STAGE + 32 * kk) >> 4)
                        for i in range(rows):
                            for j in range(16):
                                want = ((wg * 64 if op == "A" else 0) + i, 16 * kk + j)
                                got = st.get(desc_read(d, i, j))
                                checked += 1
                                if got != want:
                                    bad += 1
                                    if bad < 10:
                                        print(f"{op} buf {buf} wg {wg} kk {kk} ({i},{j}): reads {got}, want {want}")
    # End to end: integers, so the sums are exact.
    rnd = random.Random(7)
    A = [[rnd.randint(-8, 8) for _ in range(PG_BK)] for _ in range(BM)]
    B = [[rnd.randint(-8, 8) for _ in range(PG_BK)] for _ in range(PG_BN)]
    base = 1024
    smem = {}
    for op, M in (("A", A), ("B", B)):
        st, _ = stores(base, 0, op)
        for a, (r, k) in st.items():
            smem[a] = M[r][k]
    D = {}
    for wg in (0, 1):
        da, db = wg_desc(base + wg * 64 * 128), wg_desc(base + 2 * STAGE)
        acc = [[0] * 128 for _ in range(64)]  # the warpgroup's 64 × 128 result
        for kk in range(PG_BK // 16):
            o = (32 * kk) >> 4
            for i in range(64):
                for n in range(128):
                    acc[i][n] += sum(smem[desc_read(da + o, i, j)] * smem[desc_read(db + o, n, j)] for j in range(16))
        # The D fragment: thread (warp w of the group, lane 4g + t), register 4j + 2h + e is row
        # 16w + g + 8h, column 8j + 2t + e; pg_tile_w's epilogue names r = 64wg + 16w + g.
        for tid in range(128):
            w, lane = tid // 32, tid % 32
            g, t = lane // 4, lane % 4
            regs = [acc[16 * w + g + 8 * ((q >> 1) & 1)][8 * (q // 4) + 2 * t + (q & 1)] for q in range(64)]
            r = 64 * wg + 16 * w + g
            for j in range(PG_BN // 8):
                n = 8 * j + 2 * t
                D[(r, n)], D[(r, n + 1)] = regs[4 * j], regs[4 * j + 1]
                D[(r + 8, n)], D[(r + 8, n + 1)] = regs[4 * j + 2], regs[4 * j + 3]
    assert len(D) == BM * PG_BN
    for r in range(BM):
        for n in range(PG_BN):
            if D[(r, n)] != sum(A[r][k] * B[n][k] for k in range(PG_BK)):
                bad += 1
    print("wgmma swizzle emulation:", "OK" if bad == 0 else f"{bad} mismatches",
          f"({checked} descriptor reads against the stores, store bank groups, A·Bᵀ 128 × 128 through the D layout)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
