//! `dsv4 bench --backend cuda --synthetic kernels`: every weight format's product kernel on
//! its own (llm.c's `dev/cuda` habit): random valid blocks drawn on the device, checked against
//! the CPU decoder (`dsv4_model::quant`, f64 dot products), then timed at 1, 2, 4, 8 and 16
//! rows with CUDA events (launches back to back). The figure is weight bytes read once per call over the time, against
//! the 4.3 TB/s the H200 copies at. Then the int8-activation path of Q8_0, Q2_K and IQ2_XXS,
//! checked against its CPU twin and the exact product, timed the same way. Then products of
//! 64 to 4096 rows on the tensor-core tiles (prefill), as TFLOP/s. Then the token choice
//! (`draw.cu`, greedy and sampled) against its CPU twin, in µs a call. Then a MoE block's
//! experts (routed and shared, V4-Flash's shapes in ds4's q2 formats) at 1 and 3 rows, with
//! their weights from DRAM and from L2; the chain of empty kernel boundaries; and the
//! attention's one-row products and a layer's latency-bound stages at V4-Flash's shapes.
//! `--tables` picks the tables, so that a kernel variant's
//! run times only what it changes.

use anyhow::{bail, Context, Result};
use dsv4_backend::cuda::{CudaBackend, CudaWeight};
use dsv4_backend::Backend;
use dsv4_model::PackedFormat;

const HBM_BYTES_PER_S: f64 = 4.3e12;
const ROWS: [usize; 5] = [1, 2, 4, 8, 16];
/// Row counts of the int8 table: also the batch-32/64 and verify sizes the tensor-core tiles
/// serve (above `DSV4_X8_MAX_ROWS` a product takes the bf16 path, so set it to time those).
const X8_ROWS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Row counts of the many-row table (gemm.cu's tensor-core tiles): a batch-64 decode step and
/// prefill chunks.
const PG_ROWS: [usize; 4] = [64, 256, 1024, 4096];

/// The weight's f32 values as the CPU decoder gives them (bf16: the rounded values).
fn host_values(b: &CudaBackend, w: &CudaWeight) -> Vec<f32> {
    match b.download_packed(w) {
        Some(p) => p.dequantize(w.rows, w.cols),
        None => b.download_weight_f32(w),
    }
}

/// Max |gpu − ref| / max |ref| of `x · wᵀ` on `n` rows.
fn check(b: &CudaBackend, w: &CudaWeight, vals: &[f32], n: usize) -> f64 {
    let (m, k) = (w.rows, w.cols);
    let x: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0).collect();
    let xd = b.to_device(n, k, &x);
    let got = b.to_host(&b.matmul(&xd, w));
    let (mut err, mut scale) = (0f64, 0f64);
    for r in 0..n {
        for o in 0..m {
            let s: f64 = (0..k).map(|c| x[r * k + c] as f64 * vals[o * k + c] as f64).sum();
            err = err.max((got[r * m + o] as f64 - s).abs());
            scale = scale.max(s.abs());
        }
    }
    err / scale.max(f64::MIN_POSITIVE)
}

/// Weight bytes the bandwidth tables cycle through, several times the 50 MB L2 of an H100 or
/// H200: a product then reads its weights from DRAM, as a decode step's do. (Timing one weight
/// back to back read a weight of up to ~50 MB from L2: Q8_0 [4096, 8192] "ran" at 107 % of
/// 4.3 TB/s on the H200.)
const ROTATE_BYTES: usize = 256 << 20;

/// Random copies of one shape and format (seeds from `seed`) that together pass
/// [`ROTATE_BYTES`]; the first is the checked one.
fn copies(b: &CudaBackend, f: Option<PackedFormat>, m: usize, k: usize, seed: u64) -> Vec<CudaWeight> {
    let one = |s: u64| match f {
        Some(f) => b.upload_random_packed(f, m, k, 0.02, s),
        None => b.upload_random("layers.0.attn.wq_b.weight", &[m, k], 0.0, 0.02, s),
    };
    let first = one(seed);
    let n = ROTATE_BYTES.div_ceil(first.bytes().max(1)).max(1);
    std::iter::once(first).chain((1..n as u64).map(|i| one(seed + 1000 * i))).collect()
}

/// Time of one product of `n` rows, in seconds: the median over 5 runs of `reps` products
/// launched back to back between two events (one launch alone would also time the host's
/// launch latency, which a graph replay does not pay), each on the next of `ws` in turn.
fn time(b: &CudaBackend, ws: &[CudaWeight], n: usize, reps: usize) -> f64 {
    let cols = ws[0].cols;
    let x: Vec<f32> = (0..n * cols).map(|i| (i % 17) as f32 * 0.01).collect();
    let xd = b.to_device(n, cols, &x);
    for w in ws.iter().take(3) {
        b.matmul(&xd, w);
    }
    let reps = reps.max(ws.len());
    let mut ts: Vec<f64> = (0..5)
        .map(|_| {
            let e0 = b.timing_event();
            for i in 0..reps {
                drop(b.matmul(&xd, &ws[i % ws.len()]));
            }
            let e1 = b.timing_event();
            b.synchronize();
            e0.elapsed_ms(&e1).unwrap_or(f32::NAN) as f64 / 1e3 / reps as f64
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    ts[2]
}

pub fn run(tables: &str) -> Result<()> {
    let b = CudaBackend::new(0).context("starting the CUDA backend")?;
    let all = ["products", "int8", "tiles", "draws", "experts", "chain", "onerow", "stages"];
    let on: Vec<&str> = if tables == "all" { all.to_vec() } else { tables.split(',').map(str::trim).collect() };
    if let Some(t) = on.iter().find(|t| !all.contains(t)) {
        bail!("--tables: no table `{t}` (the tables: {}, or all)", all.join(", "));
    }
    let want = |t: &str| on.contains(&t);
    // The backend's own setting (int8 activations on unless `DSV4_INT8=0`), which the tables
    // after the tiles' run under: the experts ran on the f32-activation kernels while the int8
    // table's end left it off (to 1245b79), not on the step's moe_up1s / moe_down1s.
    let int8 = b.int8();
    b.set_int8(false); // the first table: the f32-activation products
    println!(
        "kernel bench on {}: products x[n, k] · w[m, k]ᵀ (bytes = weight bytes read once; the GB/s tables cycle \
         through {} MB of copies, so weights come from DRAM; % of 4.3 TB/s, the H200's copy rate)",
        b.device_name(),
        ROTATE_BYTES >> 20
    );
    // (format, m, k): an attention projection (wq_b), the output projection's second half
    // (wo_b) and a routed expert's gate/up shape, in the formats V4 checkpoints use.
    let shapes = [(32768usize, 1024usize), (4096, 8192), (2048, 4096)];
    let formats: [Option<PackedFormat>; 7] = [
        None,
        Some(PackedFormat::Q8_0),
        Some(PackedFormat::Q4_K),
        Some(PackedFormat::Q2_K),
        Some(PackedFormat::IQ2_XXS),
        Some(PackedFormat::Fp8),
        Some(PackedFormat::Fp4),
    ];
    let mut table = Vec::new();
    for f in formats.into_iter().filter(|_| want("products")) {
        for (si, &(m, k)) in shapes.iter().enumerate() {
            let ws = copies(&b, f, m, k, 11 + si as u64);
            let w = &ws[0];
            let name = f.map_or("bf16", |f| f.name());
            let vals = host_values(&b, w);
            let err = check(&b, w, &vals, 3);
            // Fast-mode bf16 products round the activations to bf16 (`gemvt_bf16`, cuBLAS):
            // about 2^-9 relative a term, so the test's 1e-2 bound; the packed products keep f32
            // activations in this table.
            let tol = if f.is_none() && !b.exact() { 1e-2 } else { 1e-4 };
            if err.is_nan() || err >= tol {
                bail!("{name} [{m}, {k}]: product differs from the CPU decoder's by {err:.2e}");
            }
            let bytes = w.bytes() as f64;
            let mut line = format!("{name:>8} [{m:>5}, {k:>4}] {:7.1} MB  err {err:.1e}:", bytes / 1e6);
            let mut gbs = Vec::new();
            for n in ROWS {
                let t = time(&b, &ws, n, 20);
                let r = bytes / t;
                gbs.push(r / 1e9);
                line += &format!("  {n:>2} rows {:6.0} GB/s ({:3.0}%)", r / 1e9, 100.0 * r / HBM_BYTES_PER_S);
            }
            println!("{line}");
            table.push(serde_json::json!({"format": name, "m": m, "k": k, "bytes": bytes, "rel_err": err,
                "rows": ROWS, "gb_per_s": gbs}));
        }
    }
    // The int8-activation path (dp4a): one row checked against its CPU twin (dsv4_backend::x8,
    // the same sums: expected bitwise) and against the exact product (the activations' rounding).
    b.set_int8(true);
    let mut x8_table = Vec::new();
    for f in [PackedFormat::Q8_0, PackedFormat::Q2_K, PackedFormat::IQ2_XXS].into_iter().filter(|_| want("int8")) {
        for (si, &(m, k)) in shapes.iter().enumerate() {
            let ws = copies(&b, Some(f), m, k, 11 + si as u64);
            let w = &ws[0];
            let vals = host_values(&b, w);
            let raw = b.download_packed(w).expect("packed").blocks;
            let x: Vec<f32> = (0..k).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0).collect();
            let got = b.to_host(&b.matmul(&b.to_device(1, k, &x), w));
            let (xq, xd) = dsv4_backend::x8::quantize(&x);
            let rb = f.row_bytes(k);
            let (mut twin, mut exact, mut scale) = (0f64, 0f64, 0f64);
            for o in 0..m {
                let t = dsv4_backend::x8::dot(f, &raw[o * rb..(o + 1) * rb], k, &xq, &xd) as f64;
                let e: f64 = (0..k).map(|c| x[c] as f64 * vals[o * k + c] as f64).sum();
                twin = twin.max((got[o] as f64 - t).abs());
                exact = exact.max((got[o] as f64 - e).abs());
                scale = scale.max(e.abs());
            }
            let (twin, exact) = (twin / scale.max(f64::MIN_POSITIVE), exact / scale.max(f64::MIN_POSITIVE));
            if twin.is_nan() || twin > 1e-6 {
                bail!("int8 {} [{m}, {k}]: product differs from the CPU twin's by {twin:.2e}", f.name());
            }
            let bytes = w.bytes() as f64;
            let mut line = format!(
                "int8 {:>8} [{m:>5}, {k:>4}] {:7.1} MB  vs twin {twin:.1e}, vs exact {exact:.1e}:",
                f.name(),
                bytes / 1e6
            );
            let mut gbs = Vec::new();
            for n in X8_ROWS {
                let r = bytes / time(&b, &ws, n, 20);
                gbs.push(r / 1e9);
                line += &format!("  {n:>2} rows {:6.0} GB/s ({:3.0}%)", r / 1e9, 100.0 * r / HBM_BYTES_PER_S);
            }
            println!("{line}");
            x8_table.push(serde_json::json!({"format": f.name(), "m": m, "k": k, "bytes": bytes, "rel_err_twin": twin,
                "rel_err_exact": exact, "rows": X8_ROWS, "gb_per_s": gbs}));
        }
    }
    b.set_int8(false);
    // Many rows (prefill chunks, large decode batches): the tensor-core tiles of gemm.cu
    // (`DSV4_PGEMM=0`: the bf16 scratch and cuBLAS they replace). Checked at 20 rows against
    // the CPU decoder (bf16 operands: the 1e-2 bound), timed as FLOP/s.
    let mut pg_table = Vec::new();
    let tiles_rows = b.tiles_dense_rows();
    b.set_tiles_dense_rows(usize::MAX);
    for f in formats.into_iter().flatten().filter(|_| want("tiles")) {
        for (si, &(m, k)) in shapes.iter().enumerate() {
            let w = b.upload_random_packed(f, m, k, 0.02, 11 + si as u64);
            let err = check(&b, &w, &host_values(&b, &w), 20);
            if err.is_nan() || err >= 1e-2 {
                bail!("tiles {} [{m}, {k}]: product differs from the CPU decoder's by {err:.2e}", f.name());
            }
            let mut line = format!("tiles {:>8} [{m:>5}, {k:>4}]  err {err:.1e}:", f.name());
            let mut tfs = Vec::new();
            for n in PG_ROWS {
                let r = 2.0 * (n * m * k) as f64 / time(&b, std::slice::from_ref(&w), n, 5);
                tfs.push(r / 1e12);
                line += &format!("  {n:>4} rows {:6.1} TFLOP/s", r / 1e12);
            }
            println!("{line}");
            pg_table.push(serde_json::json!({"format": f.name(), "m": m, "k": k, "rel_err": err, "rows": PG_ROWS,
                "tflop_per_s": tfs}));
        }
    }
    b.set_tiles_dense_rows(tiles_rows);
    b.set_int8(int8);
    let draw_table = if want("draws") { draws(&b)? } else { Vec::new() };
    let expert_table = if want("experts") { experts(&b)? } else { Vec::new() };
    let chain_table = if want("chain") { chain(&b)? } else { Vec::new() };
    let onerow_table = if want("onerow") { onerow(&b)? } else { Vec::new() };
    let stage_table = if want("stages") { stages(&b)? } else { Vec::new() };
    println!(
        "{}",
        serde_json::json!({"device": b.device_name(), "kernels": table, "int8": x8_table, "tiles": pg_table,
            "draws": draw_table, "experts": expert_table, "chain": chain_table,
            "onerow": onerow_table, "stages": stage_table})
    );
    Ok(())
}

/// The token choice (`draw.cu`) on 1, 16 and 64 rows of V4's 129,280 logits, uniform in
/// [-10, 10]: greedy and three sampled settings, each row checked against the CPU twin, then
/// timed as µs a call (one block a row; the draw table's upload and the ids' download are in
/// the figure, ~35 µs on the H100).
fn draws(b: &CudaBackend) -> Result<Vec<serde_json::Value>> {
    use dsv4_backend::draw::{draw_row, Draw};
    let cols = 129_280;
    let mut s = 77u64;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let settings = [
        ("greedy", Draw::GREEDY),
        ("T 1", Draw { temperature: 1.0, ..Draw::GREEDY }),
        ("T 0.7 top-p 0.95", Draw { temperature: 0.7, top_p: 0.95, ..Draw::GREEDY }),
        ("T 0.7 top-k 40", Draw { temperature: 0.7, top_k: 40, ..Draw::GREEDY }),
    ];
    let mut out = Vec::new();
    for rows in [1usize, 16, 64] {
        let data: Vec<f32> = (0..rows * cols).map(|_| (next() * 20.0 - 10.0) as f32).collect();
        let t = b.to_device(rows, cols, &data);
        let mut line = format!("draw_rows {rows:>2} rows of {cols}:");
        let mut us = Vec::new();
        for (name, d) in settings {
            let draws: Vec<Draw> = (0..rows).map(|i| Draw { u: (i as f64 + 0.5) / rows as f64, ..d }).collect();
            let got = b.draw_rows(&t, &draws);
            for (r, d) in draws.iter().enumerate() {
                let want = draw_row(&data[r * cols..(r + 1) * cols], d);
                if got[r] != want {
                    bail!("draw_rows ({name}) row {r}: the device drew {}, its CPU twin {want}", got[r]);
                }
            }
            let t0 = std::time::Instant::now();
            for _ in 0..20 {
                b.draw_rows(&t, &draws);
            }
            let x = t0.elapsed().as_secs_f64() / 20.0 * 1e6;
            us.push(x);
            line += &format!("  {name} {x:6.1} µs");
        }
        println!("{line}");
        out.push(serde_json::json!({"rows": rows, "cols": cols, "settings": settings.map(|s| s.0), "us": us}));
    }
    Ok(out)
}

/// A MoE block's experts (`Backend::moe_shared`: the routed sum, the shared expert and their
/// sum) at V4-Flash's shapes in ds4's q2 formats (gate/up IQ2_XXS [2048, 4096], down Q2_K
/// [4096, 2048], the shared expert Q8_0; 6 slots a row) on 1 and 3 rows (a decode step and a
/// DSpark verify of 1 + 2 drafts), as the default settings run them (one row: `moe_up1s` and
/// `moe_down1s`). Two cases: "dram" routes each call to 6 random distinct experts a row out of
/// EXPERTS (several times the L2, and each call the next of 32 routes), so the weights come from
/// DRAM as in a decode step; "l2" puts one expert in every slot, so that after the first call
/// a call's weights are L2 hits (the same instructions, the same grid). Where the two match,
/// the kernels are bound by their own instruction chains, not by DRAM's latency or bandwidth.
/// At one row the values are checked against the separate launches (`set_ffn1(false)`, expected
/// bitwise; at 3 rows both take the several-row kernels, which `cuda_packed` holds to the
/// one-row sums). The figure is µs a call and the distinct weight bytes over it.
fn experts(b: &CudaBackend) -> Result<Vec<serde_json::Value>> {
    use dsv4_model::weights::Expert;
    const D: usize = 4096;
    const INTER: usize = 2048;
    const K: usize = 6;
    const EXPERTS: usize = 128;
    const ROUTES: usize = 32;
    const LIMIT: f32 = 10.0;
    let draw = |f: PackedFormat, m: usize, k: usize, s: u64| b.upload_random_packed(f, m, k, 0.02, s);
    let ex: Vec<Expert<CudaWeight>> = (0..EXPERTS as u64)
        .map(|e| Expert {
            w1: draw(PackedFormat::IQ2_XXS, INTER, D, 7000 + 10 * e),
            w3: draw(PackedFormat::IQ2_XXS, INTER, D, 7001 + 10 * e),
            w2: draw(PackedFormat::Q2_K, D, INTER, 7002 + 10 * e),
        })
        .collect();
    let shared = Expert {
        w1: draw(PackedFormat::Q8_0, INTER, D, 6990),
        w3: draw(PackedFormat::Q8_0, INTER, D, 6991),
        w2: draw(PackedFormat::Q8_0, D, INTER, 6992),
    };
    let ebytes = ex[0].w1.bytes() + ex[0].w3.bytes() + ex[0].w2.bytes();
    let sbytes = shared.w1.bytes() + shared.w3.bytes() + shared.w2.bytes();
    let mut s = 4242u64;
    let mut next = move |m: usize| {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) as usize) % m
    };
    let busy = Busy::new(b);
    let mut out = Vec::new();
    println!(
        "experts: routed IQ2_XXS/IQ2_XXS/Q2_K [{INTER}, {D}] ({:.1} MB an expert), shared Q8_0 ({:.1} MB), {K} slots a row, \
         {} activations",
        ebytes as f64 / 1e6,
        sbytes as f64 / 1e6,
        if b.int8() { "int8 (the step's kernels)" } else { "f32 (DSV4_INT8=0)" }
    );
    for n in [1usize, 3] {
        let x: Vec<f32> = (0..n * D).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0).collect();
        // The int8 codes beside x, as the sub-block's norm leaves them.
        let x = b.rms_norm(&b.to_device(n, D, &x), None, D, 1e-6);
        let wts: Vec<f32> = (0..n * K).map(|i| 0.1 + 0.05 * (i % K) as f32).collect();
        let dram: Vec<Vec<u32>> = (0..ROUTES)
            .map(|_| {
                let mut ids = Vec::with_capacity(n * K);
                for _ in 0..n {
                    let mut row: Vec<u32> = Vec::with_capacity(K);
                    while row.len() < K {
                        let e = next(EXPERTS) as u32;
                        if !row.contains(&e) {
                            row.push(e);
                        }
                    }
                    ids.extend(row);
                }
                ids
            })
            .collect();
        for (case, routes) in [("dram", dram), ("l2", vec![vec![0u32; n * K]])] {
            let routes: Vec<_> = routes.iter().map(|ids| (ids, b.route_from_host(K, EXPERTS, ids, &wts))).collect();
            // The separate launches' values against the default path's (bitwise at one row;
            // the several-row kernels keep each row's one-row sums too).
            let (ids0, r0) = &routes[0];
            // One row: the separate launches' values against the two launches' (bitwise). The
            // "l2" case's repeated expert is not a route a router gives (its slots are distinct),
            // and the separate launches' grouping does not take it: not checked there.
            let mut err = 0f32;
            if case == "dram" {
                let got = b.moe_shared(&x, r0, &ex, 0, &shared, LIMIT);
                let ffn1 = b.ffn1();
                b.set_ffn1(false);
                let want = b.moe_shared(&x, r0, &ex, 0, &shared, LIMIT);
                b.set_ffn1(ffn1);
                let (got, want) = (b.to_host(&got.2), b.to_host(&want.2));
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(f32::MIN_POSITIVE);
                err = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / scale;
                if err.is_nan() || err > 1e-6 {
                    bail!("experts, {n} rows: the default path differs from the separate launches by {err:.2e}");
                }
            }
            let mut distinct: Vec<u32> = ids0.to_vec();
            distinct.sort_unstable();
            distinct.dedup();
            let bytes = (distinct.len() * ebytes + sbytes) as f64;
            for (_, r) in routes.iter().take(3) {
                drop(b.moe_shared(&x, r, &ex, 0, &shared, LIMIT));
            }
            // A call's host work (its tables and launches, ~100 µs) outlasts its kernels
            // (`Busy::time`).
            let t = busy.time(b, 32, |i| {
                drop(b.moe_shared(&x, &routes[i % routes.len()].1, &ex, 0, &shared, LIMIT));
            });
            println!(
                "experts {n} rows, {case:>4}: {:2} distinct experts + shared, {:6.1} MB  vs apart {err:.1e}: {:7.1} µs a call, {:6.0} GB/s ({:3.0}%)",
                distinct.len(),
                bytes / 1e6,
                t * 1e6,
                bytes / t / 1e9,
                100.0 * bytes / t / HBM_BYTES_PER_S
            );
            out.push(serde_json::json!({"rows": n, "case": case, "distinct": distinct.len(), "bytes": bytes,
                "rel_err_apart": err, "us": t * 1e6}));
        }
    }
    Ok(out)
}

/// The attention's one-row int8 products at V4-Flash's shapes in Q8_0 (as ds4's q2 files keep
/// them), each alone: wq_b (`[32768, 1024]`: gemv1x4), wo_a grouped with its output's codes (8
/// groups of `[1024, 4096]`: gemv1xq, the step's form), the same without the codes (gemv1x),
/// wo_a's weight as one ungrouped product, and wo_b (`[4096, 8192]`: gemv1x). µs a call from
/// DRAM (copies cycled) and from L2 (one copy again). v46's ncu put wo_a at ~20 µs where wq_b
/// moves the same 35.7 MB in ~12: the rows say whether the codes' tickets, the groups' separate
/// activations or the longer rows cost it. Each form is checked against the CPU twin's sums
/// (`dsv4_backend::x8::dot`, the same sums: expected bitwise).
fn onerow(b: &CudaBackend) -> Result<Vec<serde_json::Value>> {
    // (name, outputs, k, groups, the output's codes)
    let forms = [
        ("wq_b", 32768usize, 1024usize, 1usize, false),
        ("wo_a, codes", 8192, 4096, 8, true),
        ("wo_a", 8192, 4096, 8, false),
        ("wo_a ungrouped", 8192, 4096, 1, false),
        ("wo_b", 4096, 8192, 1, false),
    ];
    let (twin0, int80) = (b.gemv_twin(), b.int8());
    let busy = Busy::new(b);
    let mut out = Vec::new();
    b.set_int8(true);
    for (i, &(name, m, k, groups, codes)) in forms.iter().enumerate() {
        b.set_gemv_twin(codes);
        let ws = copies(b, Some(PackedFormat::Q8_0), m, k, 31 + i as u64);
        let w = &ws[0];
        let cols = groups * k;
        let xh: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0).collect();
        let x = b.to_device(1, cols, &xh);
        let call = |w: &CudaWeight| if groups > 1 { b.grouped_matmul(&x, w, groups) } else { b.matmul(&x, w) };
        let got = b.to_host(&call(w));
        let raw = b.download_packed(w).expect("packed").blocks;
        let (xq, xd) = dsv4_backend::x8::quantize(&xh);
        let (rb, rpg, blk) = (PackedFormat::Q8_0.row_bytes(k), m / groups, dsv4_backend::x8::BLOCK);
        let (mut err, mut scale) = (0f64, 0f64);
        for (o, g) in got.iter().enumerate() {
            let x0 = (o / rpg) * k;
            let t = dsv4_backend::x8::dot(
                PackedFormat::Q8_0,
                &raw[o * rb..(o + 1) * rb],
                k,
                &xq[x0..x0 + k],
                &xd[x0 / blk..(x0 + k) / blk],
            );
            err = err.max((*g as f64 - t as f64).abs());
            scale = scale.max((t as f64).abs());
        }
        let err = err / scale.max(f64::MIN_POSITIVE);
        if err.is_nan() || err > 1e-6 {
            bail!("one-row {name}: differs from the CPU twin by {err:.2e}");
        }
        let bytes = w.bytes() as f64;
        let dram = busy.time(b, 32, |i| drop(call(&ws[i % ws.len()])));
        let l2 = busy.time(b, 32, |_| drop(call(w)));
        println!(
            "one row {name:>15} [{m:>5}, {k:>4}] x{groups} {:5.1} MB  vs twin {err:.1e}: dram {:6.1} µs ({:5.0} GB/s), l2 {:6.1} µs ({:5.0} GB/s)",
            bytes / 1e6,
            dram * 1e6,
            bytes / dram / 1e9,
            l2 * 1e6,
            bytes / l2 / 1e9
        );
        out.push(serde_json::json!({"name": name, "m": m, "k": k, "groups": groups, "codes": codes, "bytes": bytes,
            "rel_err_twin": err, "dram_us": dram * 1e6, "l2_us": l2 * 1e6}));
    }
    b.set_gemv_twin(twin0);
    b.set_int8(int80);
    Ok(out)
}

/// The latency-bound stages of a decode layer at one row, each alone at V4-Flash's shapes
/// (their weights stay in L2): HC_PRE with the sub-block's RMSNorm, HC_POST (with the next
/// HC_PRE's sums where `hc_post_dot` is on; the line says which), the router (logits and choice
/// of a learned-routing layer) and a lone RMSNorm. HC_PRE runs on HC_POST's output, as in the
/// step, so that it uses the sums HC_POST formed rather than forming them again.
/// µs a call, launched eagerly back to back behind queued work (`Busy::time`). An eager launch
/// boundary costs more than a recorded one (the chain table: ~2.7 against ~0.8 µs on an H100);
/// the table prints the eager empty link beside them, so a stage's cost in a recorded step is
/// about its figure less the difference. Their values are checked against the CPU oracle by the
/// CUDA tests; here only that every output is finite.
fn stages(b: &CudaBackend) -> Result<Vec<serde_json::Value>> {
    use dsv4_backend::synth::hc_weights;
    let cfg = crate::flash_bench::flash_layers(4);
    let l = cfg.layers.iter().position(|s| !s.hash_moe).context("a learned-routing layer")?;
    let (d, hcw, mix, ne) = (cfg.hidden, cfg.hc_width(), cfg.hc_mix(), cfg.n_routed_experts);
    let mut seed = 500u64;
    let mut mk = |name: &str, shape: &[usize], mean: f32, std: f32| {
        seed += 1;
        b.upload_random(name, shape, mean, std, seed)
    };
    // The same names and distributions as `--synthetic flash` draws (dsv4_backend::synth).
    let hc_attn = hc_weights(&mut mk, &cfg, l, "attn", mix, 3);
    let hc_ffn = hc_weights(&mut mk, &cfg, l, "ffn", mix, 3);
    let norm = mk(&format!("layers.{l}.attn_norm.weight"), &[d], 1.0, 0.1);
    let gate = mk(&format!("layers.{l}.ffn.gate.weight"), &[ne, d], 0.0, (d as f32).powf(-0.5));
    let bias = mk(&format!("layers.{l}.ffn.gate.bias"), &[ne], 0.0, 0.1);
    let wave =
        |n: usize, s: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919 + s) % 1013) as f32 / 1013.0 - 0.5).collect() };
    let x = b.to_device(1, hcw, &wave(hcw, 1));
    let f = b.to_device(1, d, &wave(d, 2));
    let (_, a, post, comb) = b.hc_pre_norm(&x, &hc_attn, &norm, &cfg);
    let after = b.hc_post_next(&f, &x, &post, &comb, &hc_ffn, &cfg);
    let (logits, _) = b.router(&a, &gate, Some(&bias), None, &cfg);
    for (name, t) in [("hc_pre_norm", &a), ("hc_post_next", &after), ("router logits", &logits)] {
        if b.to_host(t).iter().any(|v| !v.is_finite()) {
            bail!("stages: {name} gave a nonfinite value");
        }
    }
    let busy = Busy::new(b);
    let link = b.chain_bench(2, 200).map_err(anyhow::Error::msg)?.eager_us;
    let mut out = Vec::new();
    let dot = b.hc_post_dot();
    let mut line = format!("stages, 1 row (eager; an empty eager link {link:.2} µs; hc_post_dot {dot}):");
    let mut row = |name: &str, us: f64| {
        line += &format!("  {name} {us:5.1} µs");
        out.push(serde_json::json!({"stage": name, "us": us, "eager_link_us": link, "hc_post_dot": dot}));
    };
    row("hc_pre_norm", 1e6 * busy.time(b, 32, |_| drop(b.hc_pre_norm(&after, &hc_ffn, &norm, &cfg))));
    row("hc_post_next", 1e6 * busy.time(b, 32, |_| drop(b.hc_post_next(&f, &x, &post, &comb, &hc_ffn, &cfg))));
    row("router", 1e6 * busy.time(b, 32, |_| drop(b.router(&a, &gate, Some(&bias), None, &cfg))));
    row("rms_norm", 1e6 * busy.time(b, 32, |_| drop(b.rms_norm(&f, Some(&norm), d, cfg.rms_eps))));
    println!("{line}");
    Ok(out)
}

/// The chain table (`CudaBackend::chain_bench`): µs a kernel boundary of empty links, launched
/// one by one, recorded (PDL edges), recorded with half the edges a side branch's fork or join,
/// and as grid barriers inside one launch, at a decode kernel's small grids and at one block an SM.
fn chain(b: &CudaBackend) -> Result<Vec<serde_json::Value>> {
    const LINKS: usize = 200;
    let mut out = Vec::new();
    for blocks in [2, 16, b.sm_count()] {
        let t = b.chain_bench(blocks, LINKS).map_err(anyhow::Error::msg)?;
        println!(
            "chain of {LINKS} empty links, {:3} blocks: eager {:5.2} µs a link, recorded {:5.2}, recorded with joins {:5.2}, \
             grid barrier {:5.2}",
            t.blocks, t.eager_us, t.graph_us, t.graph_join_us, t.barrier_us
        );
        out.push(serde_json::json!({"blocks": t.blocks, "links": t.links, "eager_us": t.eager_us,
            "graph_us": t.graph_us, "graph_join_us": t.graph_join_us, "barrier_us": t.barrier_us}));
    }
    Ok(out)
}

/// GPU work of a known length that the host queues in a few µs a unit (a bf16 product of 16
/// rows with a 134 MB weight, ~50 µs on an H100): queued before a timed run of calls whose host
/// side is slower than their kernels, so that they run back to back behind it.
struct Busy {
    w: CudaWeight,
    x: dsv4_backend::cuda::CudaTensor,
    /// Seconds of GPU time a unit.
    each: f64,
}

impl Busy {
    fn new(b: &CudaBackend) -> Self {
        let w = b.upload_random("busy.weight", &[16384, 4096], 0.0, 0.02, 99);
        let x = b.to_device(16, 4096, &vec![0.01f32; 16 * 4096]);
        let mut me = Busy { w, x, each: 1.0 };
        me.queue(b, 4);
        let e0 = b.timing_event();
        me.queue(b, 20);
        let e1 = b.timing_event();
        b.synchronize();
        me.each = (e0.elapsed_ms(&e1).unwrap_or(f32::NAN) as f64 / 1e3 / 20.0).max(1e-6);
        me
    }

    fn queue(&self, b: &CudaBackend, units: usize) {
        for _ in 0..units {
            drop(b.matmul(&self.x, &self.w));
        }
    }

    /// Seconds a call of `call(i)` (`i`: the call's index in its pass) takes on the GPU: the
    /// median of 5 passes (after 2 warm ones) of `reps` calls. Each pass first queues this work
    /// for 1.5× the previous pass's host time, so that the host queues every call behind it and
    /// the events time the calls' kernels back to back, as a replayed step runs them.
    fn time(&self, b: &CudaBackend, reps: usize, mut call: impl FnMut(usize)) -> f64 {
        let mut pre = 0usize;
        let mut ts: Vec<f64> = (0..7)
            .map(|_| {
                self.queue(b, pre);
                let e0 = b.timing_event();
                let h = std::time::Instant::now();
                for i in 0..reps {
                    call(i);
                }
                let host = h.elapsed().as_secs_f64();
                let e1 = b.timing_event();
                b.synchronize();
                pre = (1.5 * host / self.each).ceil() as usize + 1;
                e0.elapsed_ms(&e1).unwrap_or(f32::NAN) as f64 / 1e3 / reps as f64
            })
            .skip(2)
            .collect();
        ts.sort_by(f64::total_cmp);
        ts[2]
    }
}
