//! Packed weights on the GPU (FP8, FP4, Q8_0, Q4_K, Q2_K, IQ2_XXS kept in their blocks and
//! dequantised inside the kernels) against the CPU oracle, which dequantises the same blocks
//! with `dsv4_model::quant`. Skips without a CUDA device.
//!
//! Tolerances: the small-batch and exact-mode kernels use the CPU's dequantised values exactly
//! and f32 activations, so they differ from the f64 reference only by f32 summation order
//! (≤ 1e-5 of the output's scale). The large-batch path rounds weights and activations to bf16
//! for cuBLAS (2^-8 relative each), so it is held to 2e-2.
#![cfg(feature = "cuda")]

mod common;

use common::{gpu, rel_err};
use dsv4_backend::cpu::{CpuBackend, Tensor};
use dsv4_backend::cuda::quant::{X8Tiles, QGEMV_ROWS};
use dsv4_backend::cuda::{CudaBackend, CudaRoute, CudaTensor, CudaWeight};
use dsv4_backend::Backend;
use dsv4_model::packed::{Packed, PackedFormat};
use dsv4_model::quant;
use dsv4_model::weights::Expert;
use dsv4_model::HostTensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Random valid blocks of `format` for a `[rows, cols]` weight of values around 0.05.
fn random_packed(format: PackedFormat, rows: usize, cols: usize, seed: u64) -> Packed {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..rows * cols).map(|_| r.gen_range(-0.1f32..0.1)).collect();
    let f16 = |v: f32| dsv4_model::packed::f16_bits(v).to_le_bytes();
    let (blocks, scales) = match format {
        PackedFormat::Q8_0 => (quant::quantize_q8_0(&x), vec![]),
        PackedFormat::Q4_K => (quant::quantize_q4_k(&x), vec![]),
        PackedFormat::Q2_K => (quant::quantize_q2_k(&x), vec![]),
        PackedFormat::IQ2_XXS => {
            let mut b: Vec<u8> = (0..rows * format.row_bytes(cols)).map(|_| r.gen()).collect();
            for blk in b.chunks_exact_mut(66) {
                blk[..2].copy_from_slice(&f16(r.gen_range(0.0005f32..0.002)));
            }
            (b, vec![])
        }
        PackedFormat::Fp8 => {
            // Any byte but the two NaNs.
            let b = (0..rows * cols).map(|_| r.gen::<u8>()).map(|v| if v & 0x7f == 0x7f { 0x38 } else { v }).collect();
            (b, (0..format.n_scales(rows, cols)).map(|_| r.gen_range(0.001f32..0.01)).collect())
        }
        PackedFormat::Fp4 => {
            let b = (0..rows * cols / 2).map(|_| r.gen()).collect();
            (b, (0..format.n_scales(rows, cols)).map(|_| 2f32.powi(r.gen_range(-8..-3))).collect())
        }
    };
    Packed { format, blocks, scales }
}

fn host(name: &str, rows: usize, cols: usize, p: &Packed) -> HostTensor {
    HostTensor { name: name.into(), shape: vec![rows, cols], data: vec![], packed: Some(p.clone()) }
}

fn activations(b: &CudaBackend, rows: usize, cols: usize, seed: u64) -> (CudaTensor, Tensor) {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let x: Vec<f32> = (0..rows * cols).map(|_| r.gen_range(-1f32..1.0)).collect();
    let w = b.upload(HostTensor::new("x", vec![rows, cols], x.clone())).unwrap();
    (CudaTensor::new(rows, cols, w.data), Tensor::new(rows, cols, x))
}

/// `ne` routed experts of random valid blocks (`w1`/`w3` in `formats.0`, `w2` in `formats.1`,
/// `dims` = (d, inter, ne)): uploaded to `b`, and as the CPU oracle's dequantised tensors.
fn random_experts(
    b: &CudaBackend,
    formats: (PackedFormat, PackedFormat),
    (d, inter, ne): (usize, usize, usize),
    seed: u64,
) -> (Vec<Expert<dsv4_backend::cuda::CudaWeight>>, Vec<Expert<Tensor>>) {
    let (mut gpu_e, mut cpu_e) = (Vec::new(), Vec::new());
    for e in 0..ne {
        let s = seed + 10 * e as u64;
        let (p1, p3, p2) = (
            random_packed(formats.0, inter, d, s),
            random_packed(formats.0, inter, d, s + 1),
            random_packed(formats.1, d, inter, s + 2),
        );
        let name = |w: &str| format!("layers.0.ffn.experts.{e}.{w}.weight");
        gpu_e.push(Expert {
            w1: b.upload(host(&name("w1"), inter, d, &p1)).unwrap(),
            w3: b.upload(host(&name("w3"), inter, d, &p3)).unwrap(),
            w2: b.upload(host(&name("w2"), d, inter, &p2)).unwrap(),
        });
        cpu_e.push(Expert {
            w1: Tensor::new(inter, d, p1.dequantize(inter, d)),
            w3: Tensor::new(inter, d, p3.dequantize(inter, d)),
            w2: Tensor::new(d, inter, p2.dequantize(d, inter)),
        });
    }
    (gpu_e, cpu_e)
}

/// `x · wᵀ` per group in f64 (`w` `[m, k]`, `x` `[n, groups·k]`).
fn reference(x: &Tensor, w: &[f32], m: usize, k: usize, groups: usize) -> Vec<f32> {
    let rpg = m / groups;
    let mut out = vec![0f32; x.rows * m];
    for r in 0..x.rows {
        for o in 0..m {
            let xo = &x.data[r * x.cols + (o / rpg) * k..][..k];
            out[r * m + o] =
                xo.iter().zip(&w[o * k..(o + 1) * k]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32;
        }
    }
    out
}

#[test]
fn cuda_packed_products_match_cpu() {
    let Some(b) = gpu() else { return };
    let (m, k) = (40, 512);
    for (fi, format) in PackedFormat::ALL.into_iter().enumerate() {
        let p = random_packed(format, m, k, 10 + fi as u64);
        let w = b.upload(host("layers.0.attn.wq_a.weight", m, k, &p)).unwrap();
        assert!(w.q.is_some(), "{} kept packed", format.name());
        let wf = p.dequantize(m, k);
        for (n, exact, tol) in
            [(1, false, 1e-5), (3, false, 1e-5), (8, false, 1e-5), (20, true, 1e-5), (20, false, 2e-2)]
        {
            b.set_exact(exact);
            let (xg, xc) = activations(&b, n, k, 100 + n as u64);
            let got = b.to_host(&b.matmul(&xg, &w));
            let e = rel_err(&got, &reference(&xc, &wf, m, k, 1));
            println!("{} n={n} exact={exact}: {e:.2e}", format.name());
            assert!(e <= tol, "{} product, {n} rows (exact {exact}): {e:.2e} > {tol:.0e}", format.name());
        }
        // The grouped projection (wo_a): two groups of 20 rows, each over its own 512 inputs.
        b.set_exact(true);
        let (xg, xc) = activations(&b, 5, 2 * k, 7);
        let wo = b.upload(host("layers.0.attn.wo_a.weight", m, k, &p)).unwrap();
        let got = b.to_host(&b.grouped_matmul(&xg, &wo, 2));
        let e = rel_err(&got, &reference(&xc, &wf, m, k, 2));
        assert!(e <= 1e-5, "{} grouped product: {e:.2e}", format.name());
    }
}

/// Exact mode's products of many rows (`gemvo`: a warp 4 outputs, a block 32 rows) give bitwise
/// what `gemv` gives, and each row bitwise its one-row product, for every format, plain and
/// grouped (wo_a's shape), with a partial block of outputs and of rows.
#[test]
fn cuda_exact_products_of_many_rows_are_bitwise_gemv() {
    let Some(b) = CudaBackend::exact_or_skip(false) else { return };
    let (m, k) = (72, 512);
    for (fi, format) in PackedFormat::ALL.into_iter().enumerate() {
        let p = random_packed(format, m, k, 140 + fi as u64);
        let w = b.upload(host("layers.0.attn.wq_a.weight", m, k, &p)).unwrap();
        let wo = b.upload(host("layers.0.attn.wo_a.weight", m, k, &p)).unwrap();
        for (n, groups) in [(17, 1), (70, 1), (40, 2)] {
            let (xg, xc) = activations(&b, n, groups * k, 150 + n as u64);
            let run = |on: bool| {
                b.set_gemvo(on);
                let y = if groups == 1 { b.matmul(&xg, &w) } else { b.grouped_matmul(&xg, &wo, groups) };
                b.to_host(&y)
            };
            let (fast, plain) = (run(true), run(false));
            for (i, (a, c)) in fast.iter().zip(&plain).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    c.to_bits(),
                    "{} {n} rows, {groups} groups, value {i}: gemvo {a} vs gemv {c}",
                    format.name()
                );
            }
            b.set_gemvo(true);
            for r in [0, n / 2, n - 1] {
                let x1 = row_of(&b, &xc, r);
                let one = b.to_host(&if groups == 1 { b.matmul(&x1, &w) } else { b.grouped_matmul(&x1, &wo, groups) });
                for o in 0..m {
                    assert_eq!(
                        fast[r * m + o].to_bits(),
                        one[o].to_bits(),
                        "{} row {r}/{n} output {o} vs alone",
                        format.name()
                    );
                }
            }
            let e = rel_err(&fast, &reference(&xc, &p.dequantize(m, k), m, k, groups));
            assert!(e <= 1e-5, "{} gemvo vs the f64 product: {e:.2e}", format.name());
        }
        println!("{}: gemvo bitwise gemv and each row alone (17, 70 rows; 2 groups of 40 rows)", format.name());
    }
}

#[test]
fn cuda_packed_experts_match_cpu() {
    let Some(b) = gpu() else { return };
    let cpu = CpuBackend;
    let cfg = dsv4_model::synth::tiny_config(64);
    let (d, inter, ne) = (256, 512, 8);
    // (w1/w3, w2) as ds4's q2 and q4 files and the official checkpoint store them.
    let pairs = [
        (PackedFormat::IQ2_XXS, PackedFormat::Q2_K),
        (PackedFormat::Q4_K, PackedFormat::Q4_K),
        (PackedFormat::Fp4, PackedFormat::Fp4),
        (PackedFormat::Q8_0, PackedFormat::Fp8),
    ];
    for (pi, (f13, f2)) in pairs.into_iter().enumerate() {
        let (gpu_e, cpu_e) = random_experts(&b, (f13, f2), (d, inter, ne), 1000 * pi as u64);
        for (n, exact, tol) in [(3, false, 1e-5), (100, true, 1e-5), (100, false, 2e-2), (200, false, 2e-2)] {
            b.set_exact(exact);
            let (xg, xc) = activations(&b, n, d, 5 + n as u64);
            let (lg, lc) = activations(&b, n, ne, 9 + n as u64);
            let mut c = cfg.clone();
            c.n_routed_experts = ne;
            c.n_experts_per_tok = 3;
            let bias_g = b.upload(HostTensor::new("bias", vec![ne], vec![0.0; ne])).unwrap();
            let bias_c = Tensor::new(1, ne, vec![0.0; ne]);
            let rg = b.route(&lg, Some(&bias_g), None, &c);
            let rc = cpu.route(&lc, Some(&bias_c), None, &c);
            let got = b.to_host(&b.moe(&xg, &rg, &gpu_e, 0, 10.0));
            let want = cpu.moe(&xc, &rc, &cpu_e, 0, 10.0);
            let e = rel_err(&got, &want.data);
            println!("{}/{} experts, {n} rows, exact {exact}: {e:.2e}", f13.name(), f2.name());
            assert!(e <= tol, "{}/{} experts, {n} rows (exact {exact}): {e:.2e} > {tol:.0e}", f13.name(), f2.name());
        }
    }
}

/// The int8-activation path (`set_int8`): products of 1 to 15 rows equal the CPU twin
/// (`dsv4_backend::x8`, the same integer sums and f32 operations) bit for bit, and the exact
/// f64 products within 2e-2 (the activations' rounding: at most max|x|/254 per value of a
/// block of 32, about a bf16 rounding); routed experts (IQ2_XXS/Q2_K, as ds4's q2 file) match
/// the CPU oracle within the same 2e-2.
#[test]
fn cuda_int8_products_match_the_twin() {
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    b.set_int8(true);
    // Up to 64 rows on the int8 path (33 rows: three row tiles of the tensor-core kernels).
    b.set_x8_rows(64);
    // k = 512: 16 chunks of 32, so half the tile kernels' chunk classes are empty; k = 1536:
    // classes of two chunks and of one. m = 40: a last tile of 8 live outputs.
    for (fi, (format, k)) in [
        (PackedFormat::Q8_0, 512),
        (PackedFormat::Q2_K, 512),
        (PackedFormat::IQ2_XXS, 512),
        (PackedFormat::Q8_0, 1536),
        (PackedFormat::Q2_K, 1536),
        (PackedFormat::IQ2_XXS, 1536),
    ]
    .into_iter()
    .enumerate()
    {
        let m = 40;
        let p = random_packed(format, m, k, 40 + fi as u64);
        let w = b.upload(host("layers.0.attn.wq_a.weight", m, k, &p)).unwrap();
        let rb = format.row_bytes(k);
        // One row, the dp4a row groups' sizes (8, 4, 2, 1), 2 to 4 rows also on the kernels
        // built for that many (gemvx2, gemvx4: `set_row_caps`) at one output a warp and at two
        // (gemvx2p, gemvx4p: `set_row_pairs`), and the tensor-core tiles' (one
        // n-tile of 8, two of 8, several blocks of 16 rows): each row bitwise its twin, so a
        // row's result does not depend on the rows beside it.
        // The tiles (8 rows and more) both with their chunks staged by cp.async (Q8_0's
        // `gemvtc`) and held in registers (`gemvt`, the default): `caps` picks the second.
        let sizes = [1, 2, 3, 4, 8, 15, 33];
        for (n, caps, pairs) in sizes
            .into_iter()
            .flat_map(|n| [(n, false, false), (n, true, false), (n, true, true)])
            .filter(|&(n, c, p)| (!c || (2..=4).contains(&n) || n >= 8) && (!p || (2..=4).contains(&n)))
        {
            b.set_row_caps(caps);
            b.set_row_pairs(pairs);
            b.set_tile_cp(!(caps && n >= 8));
            let (xg, xc) = activations(&b, n, k, 77 + fi as u64);
            let got = b.to_host(&b.matmul(&xg, &w));
            for r in 0..n {
                let (xq, xd) = dsv4_backend::x8::quantize(&xc.data[r * k..(r + 1) * k]);
                for (o, row) in p.blocks.chunks(rb).enumerate() {
                    let (g, twin) = (got[r * m + o], dsv4_backend::x8::dot(format, row, k, &xq, &xd));
                    assert_eq!(
                        g.to_bits(),
                        twin.to_bits(),
                        "{} row {r}/{n} output {o}: GPU {g} vs twin {twin}",
                        format.name()
                    );
                }
            }
            let e = rel_err(&got, &reference(&xc, &p.dequantize(m, k), m, k, 1));
            println!(
                "int8 {} {n} rows (row caps {caps}, pairs {pairs}, tiles by cp.async {}): bitwise the twin; {e:.2e} \
                 from the exact product",
                format.name(),
                b.tile_cp()
            );
            assert!(e <= 2e-2, "int8 {} vs exact: {e:.2e}", format.name());
        }
        b.set_row_caps(false);
        b.set_tile_cp(true); // the grouped projection below on the cp.async tiles too
                             // The grouped projection (wo_a's shape): two groups of 32 outputs, each over its own k
                             // inputs; tiles of 16 outputs never straddle the groups.
        if k == 512 {
            let pg = random_packed(format, 64, k, 60 + fi as u64);
            let wg = b.upload(host("layers.0.attn.wo_a.weight", 64, k, &pg)).unwrap();
            // 3 rows: gemvx4p's warps, two outputs of one group each; 5: the tiles.
            b.set_row_caps(true);
            b.set_row_pairs(true);
            for n in [3, 5] {
                let (xg, xc) = activations(&b, n, 2 * k, 83 + fi as u64);
                let got = b.to_host(&b.grouped_matmul(&xg, &wg, 2));
                for r in 0..n {
                    for (o, row) in pg.blocks.chunks(rb).enumerate() {
                        let xr = &xc.data[r * 2 * k + (o / 32) * k..][..k];
                        let (xq, xd) = dsv4_backend::x8::quantize(xr);
                        let twin = dsv4_backend::x8::dot(format, row, k, &xq, &xd);
                        assert_eq!(
                            got[r * 64 + o].to_bits(),
                            twin.to_bits(),
                            "{} grouped, {n} rows: row {r} output {o}",
                            format.name()
                        );
                    }
                }
            }
            b.set_row_caps(false);
        }
        b.set_tile_cp(false);
        // A product on an RMSNorm's output reuses the int8 codes the norm wrote beside it: bitwise
        // the product on a copy of the norm's values (quantised by the product itself).
        for n in [1, 3] {
            let (xg, _) = activations(&b, n, k, 91 + n as u64);
            let (_, nw) = activations(&b, 1, k, 97);
            let nw = b.upload(HostTensor::new("layers.0.attn_norm.weight", vec![k], nw.data)).unwrap();
            let y = b.rms_norm(&xg, Some(&nw), k, 1e-6);
            let copy = b.upload(HostTensor::new("y", vec![n, k], b.to_host(&y))).unwrap();
            let (a, c) = (b.to_host(&b.matmul(&y, &w)), b.to_host(&b.matmul(&CudaTensor::new(n, k, copy.data), &w)));
            assert!(a.iter().zip(&c).all(|(a, c)| a.to_bits() == c.to_bits()), "{} norm twin, {n} rows", format.name());
        }
    }
    let cpu = CpuBackend;
    let (d, inter, ne) = (256, 512, 8);
    let (gpu_e, cpu_e) = random_experts(&b, (PackedFormat::IQ2_XXS, PackedFormat::Q2_K), (d, inter, ne), 5000);
    let mut c = dsv4_model::synth::tiny_config(64);
    c.n_routed_experts = ne;
    c.n_experts_per_tok = 3;
    let bias_g = b.upload(HostTensor::new("bias", vec![ne], vec![0.0; ne])).unwrap();
    let bias_c = Tensor::new(1, ne, vec![0.0; ne]);
    // 24 rows: 72 pairs over 8 experts, so the tile kernels take an expert's pairs in several
    // row tiles of 8; 2 and 4 rows also on the down kernels built for that many (moe_downx2,
    // moe_downx4: `set_row_caps`). Each size on the dp4a row groups (`Dense`) and on the expert
    // tiles (`All`).
    let runs = [1, 2, 4, 5, 24].into_iter().flat_map(|n| {
        [(n, X8Tiles::Dense, false), (n, X8Tiles::Dense, true), (n, X8Tiles::All, false)]
            .into_iter()
            .filter(move |&(_, _, caps)| !caps || n == 2 || n == 4)
    });
    for (n, tiles, caps) in runs {
        b.set_x8_tiles(tiles);
        b.set_row_caps(caps);
        let (xg, xc) = activations(&b, n, d, 6);
        let (lg, lc) = activations(&b, n, ne, 10);
        let got = b.to_host(&b.moe(&xg, &b.route(&lg, Some(&bias_g), None, &c), &gpu_e, 0, 10.0));
        let want = cpu.moe(&xc, &cpu.route(&lc, Some(&bias_c), None, &c), &cpu_e, 0, 10.0);
        let e = rel_err(&got, &want.data);
        println!("int8 IQ2_XXS/Q2_K experts, {n} rows ({tiles:?}, row caps {caps}): {e:.2e}");
        assert!(e <= 2e-2, "int8 experts ({n} rows) vs the CPU oracle: {e:.2e}");
        // Batch invariance: each row alone (the one-row kernels, several outputs a warp) is
        // bitwise that row among the n (the row-group kernels).
        for r in 0..n {
            let (x1, l1) = (row_of(&b, &xc, r), row_of(&b, &lc, r));
            let one = b.to_host(&b.moe(&x1, &b.route(&l1, Some(&bias_g), None, &c), &gpu_e, 0, 10.0));
            for (i, (a, g)) in one.iter().zip(&got[r * d..(r + 1) * d]).enumerate() {
                assert_eq!(a.to_bits(), g.to_bits(), "int8 experts: row {r} alone {a} vs among {n} {g} (column {i})");
            }
        }
    }
    // The shared expert (Q8_0, as the q2 and q4 files store it): one row on the routed-expert
    // kernels (gate/up with the SwiGLU, then down) is bitwise that row among 2–4 (the row-group
    // expert kernels) and among 5 (three products and the SwiGLU kernel), and the 5 rows are
    // within 2e-2 of the CPU oracle.
    let (sg, sc) = random_experts(&b, (PackedFormat::Q8_0, PackedFormat::Q8_0), (d, inter, 1), 7000);
    let (xg, xc) = activations(&b, 5, d, 8);
    let all = b.to_host(&b.swiglu(&xg, &sg[0], 10.0));
    let e = rel_err(&all, &cpu.swiglu(&xc, &sc[0], 10.0).data);
    println!("int8 Q8_0 shared expert, 5 rows: {e:.2e}");
    assert!(e <= 2e-2, "int8 shared expert vs the CPU oracle: {e:.2e}");
    let first = |n: usize| {
        let h = HostTensor::new("x", vec![n, d], xc.data[..n * d].to_vec());
        CudaTensor::new(n, d, b.upload(h).unwrap().data)
    };
    // (2–4 rows as a decode step runs them: the dp4a row groups, the down kernels' row caps.)
    b.set_x8_tiles(X8Tiles::Dense);
    b.set_row_caps(true);
    let few: Vec<Vec<f32>> = (2..=4).map(|n| b.to_host(&b.swiglu(&first(n), &sg[0], 10.0))).collect();
    for r in 0..5 {
        let one = b.to_host(&b.swiglu(&row_of(&b, &xc, r), &sg[0], 10.0));
        for (i, (a, g)) in one.iter().zip(&all[r * d..(r + 1) * d]).enumerate() {
            assert_eq!(a.to_bits(), g.to_bits(), "shared expert: row {r} alone {a} vs among 5 {g} (column {i})");
        }
        for (n, got) in (2..=4).zip(&few).filter(|(n, _)| r < *n) {
            for (i, (a, g)) in one.iter().zip(&got[r * d..(r + 1) * d]).enumerate() {
                assert_eq!(a.to_bits(), g.to_bits(), "shared expert: row {r} alone {a} vs among {n} {g} (column {i})");
            }
        }
    }
    b.set_x8_tiles(X8Tiles::Dense);
    b.set_x8_rows(QGEMV_ROWS);
    b.set_int8(false);
}

/// One token row's experts in two launches (`moe_up1s` / `moe_down1s`, `set_ffn1`; also 2 and 4
/// distinct rows, a verify's shape) are bitwise the separate launches (moe_sort, up, quant_x8, down, moe_combine; the shared expert's up,
/// quant_x8, down; the add) for the routed, shared and summed outputs: ds4's q2 layout (IQ2_XXS
/// gate/up, Q2_K down, Q8_0 shared expert, 6 slots), Q8_0 throughout with 7 slots (8 pairs, a
/// warp each in the down kernel) and Q2_K throughout. inter = 512 or 256: at one output a warp
/// (the Q8_0 and Q2_K gate/up forms) h's 32-value groups are each finished by the last of 4 up
/// blocks, whose counters every launch must leave zero, so each case runs three times; at 4 (the
/// IQ2_XXS form's default) a block owns whole groups, against separate kernels at 1. The sum is also bitwise the first row of the same row twice
/// (the several-row kernels) and held to the CPU oracle (2e-2, the int8 activations' rounding as
/// in `cuda_int8_products_match_the_twin`). Rows of 1,280 and 768 values end a lane's batch
/// part-way (DSV4_X8_PIPE's software-pipelined form); V4's 4,096 and 2,048 (and 2,048 and 1,024)
/// are whole rounds of X8_STAGE's staged rows.
#[test]
fn cuda_one_row_experts_in_two_launches_are_bitwise() {
    let Some(b) = gpu() else { return };
    let cpu = CpuBackend;
    b.set_exact(false);
    b.set_int8(true);
    const LIMIT: f32 = 0.5;
    use PackedFormat::{IQ2_XXS, Q2_K, Q8_0};
    let cases = [
        ((IQ2_XXS, Q2_K), (Q8_0, Q8_0), 6, (256, 512, 8)),
        ((Q8_0, Q8_0), (Q8_0, Q8_0), 7, (512, 256, 9)),
        ((Q2_K, Q2_K), (Q2_K, Q2_K), 2, (256, 512, 4)),
        // Rows of 1,280 and 768 values: under DSV4_X8_PIPE, batches of 1,024 values a lane-row
        // that end part-way through a row (and a row of several batches).
        ((IQ2_XXS, Q2_K), (Q8_0, Q8_0), 6, (1280, 768, 8)),
        // V4 Flash's widths (and half of them): whole 1,024-value rounds, the rows quant.cu's
        // X8_STAGE form stages through shared memory (4 gate/up rounds in its ring of 2; 2 and 1
        // down rounds).
        ((IQ2_XXS, Q2_K), (Q8_0, Q8_0), 6, (4096, 2048, 8)),
        ((IQ2_XXS, Q2_K), (Q8_0, Q8_0), 6, (2048, 1024, 8)),
    ];
    for (ci, (routed, shared, k, (d, inter, ne))) in cases.into_iter().enumerate() {
        let seed = 9000 + 100 * ci as u64;
        let (gpu_e, cpu_e) = random_experts(&b, routed, (d, inter, ne), seed);
        let (sg, sc) = random_experts(&b, shared, (d, inter, 1), seed + 50);
        let mut c = dsv4_model::synth::tiny_config(64);
        c.n_routed_experts = ne;
        c.n_experts_per_tok = k;
        let bias_g = b.upload(HostTensor::new("bias", vec![ne], vec![0.0; ne])).unwrap();
        let bias_c = Tensor::new(1, ne, vec![0.0; ne]);
        let (xg, xc) = activations(&b, 1, d, seed + 1);
        let (lg, lc) = activations(&b, 1, ne, seed + 2);
        let name = format!(
            "{}/{} + shared {}/{}, k = {k}",
            routed.0.name(),
            routed.1.name(),
            shared.0.name(),
            shared.1.name()
        );
        // The int8 codes of x, as the sub-block's norm leaves them beside its output.
        let x = b.rms_norm(&xg, None, d, 1e-6);
        let xh = cpu.rms_norm(&xc, None, d, 1e-6);
        let rg = b.route(&lg, Some(&bias_g), None, &c);
        b.set_ffn1(false);
        // The separate launches' (routed, shared, sum) of x's rows, held against the two
        // launches `runs` times (each launch must leave the counters zero).
        let check = |x: &CudaTensor, r: &CudaRoute, runs: usize| {
            // A SwiGLU limit the gate/up values reach (the clamp's both branches run).
            let apart = b.moe_shared(x, r, &gpu_e, 0, &sg[0], LIMIT);
            let apart = [&apart.0, &apart.1, &apart.2].map(|t| b.to_host(t));
            let n = x.rows;
            for run in 0..runs {
                let fused = b.moe_shared_two_launches(x, r, &gpu_e, &sg[0], LIMIT);
                let fused = fused.unwrap_or_else(|| panic!("{name}: the two-launch path does not take {n} rows"));
                for (what, (f, a)) in
                    ["routed", "shared", "sum"].iter().zip([&fused.0, &fused.1, &fused.2].into_iter().zip(&apart))
                {
                    for (i, (f, a)) in b.to_host(f).iter().zip(a).enumerate() {
                        assert_eq!(
                            f.to_bits(),
                            a.to_bits(),
                            "{name}, {n} rows, run {run}: {what}[row {}, {}] two launches {f} vs apart {a}",
                            i / d,
                            i % d
                        );
                    }
                }
            }
            apart
        };
        let apart = check(&x, &rg, 3);
        // The same row twice takes the several-row kernels, each row bitwise its one-row sums
        // and untouched by DSV4_X8_PIPE / DSV4_X8_OPW: so those variants of the one-row kernels
        // are held to the same bits, not only to each other.
        let twice = |t: &Tensor| -> CudaTensor {
            let data: Vec<f32> = t.data.iter().chain(&t.data).copied().collect();
            let w = b.upload(HostTensor::new("x", vec![2, t.cols], data)).unwrap();
            CudaTensor::new(2, t.cols, w.data)
        };
        // (Two rows on the dp4a kernels whatever DSV4_X8_MAX_ROWS: not the tiles or cuBLAS.)
        b.set_x8_rows(64);
        let x2 = b.rms_norm(&twice(&xc), None, d, 1e-6);
        let r2 = b.route(&twice(&lc), Some(&bias_g), None, &c);
        let both = b.moe_shared(&x2, &r2, &gpu_e, 0, &sg[0], LIMIT);
        for (what, (t, a)) in
            ["routed", "shared", "sum"].iter().zip([&both.0, &both.1, &both.2].into_iter().zip(&apart))
        {
            for (i, (t, a)) in b.to_host(t)[..d].iter().zip(a).enumerate() {
                assert_eq!(t.to_bits(), a.to_bits(), "{name}: {what}[{i}] one row {a} vs the first of two {t}");
            }
        }
        // A verify's few distinct rows in the two launches (each pair its own one-row product;
        // `set_ffn1_rows`, 4 by default with quant.cu's staged rows): bitwise the separate launches of the same rows, twice
        // over (the counters).
        let start_rows = b.ffn1_rows();
        b.set_ffn1_rows(4);
        for n in [2, 3, 4] {
            let (xn, _) = activations(&b, n, d, seed + 10 + n as u64);
            let (ln, _) = activations(&b, n, ne, seed + 20 + n as u64);
            let xn = b.rms_norm(&xn, None, d, 1e-6);
            let rn = b.route(&ln, Some(&bias_g), None, &c);
            check(&xn, &rn, 2);
        }
        b.set_ffn1_rows(start_rows);
        let rc = cpu.route(&lc, Some(&bias_c), None, &c);
        let want = cpu.add(&cpu.moe(&xh, &rc, &cpu_e, 0, LIMIT), &cpu.swiglu(&xh, &sc[0], LIMIT));
        let e = rel_err(&apart[2], &want.data);
        println!("{name}: two launches bitwise the separate ones; {e:.2e} from the CPU oracle");
        assert!(e <= 2e-2, "{name} vs the CPU oracle: {e:.2e}");
    }
    b.set_int8(false);
}

/// One row's products of one input with several packed weights of one int8 format in one
/// launch (`gemv1xg`, `set_x8_group`; 2 and 4 rows: `gemvxg4p`) are bitwise each product alone
/// (`gemv1x`; `gemvx2p` / `gemvx4p`): 2 to 4 weights
/// of 40, 64, 24 and 8 outputs (blocks of 8 outputs; a last entry of one block), each format;
/// and `matmul_many` takes that path for them when the switch is on. The same with 4 outputs a
/// warp (`set_gemv4`: `gemv1x4` alone, `gemv1xg4` grouped; blocks of 32 outputs, partial ones).
#[test]
fn cuda_one_row_int8_products_in_one_launch_are_each_alone() {
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    b.set_int8(true);
    let k = 512;
    for (fi, format) in [PackedFormat::Q8_0, PackedFormat::Q2_K, PackedFormat::IQ2_XXS].into_iter().enumerate() {
        let ws: Vec<CudaWeight> = [40, 64, 24, 8]
            .iter()
            .enumerate()
            .map(|(i, &m)| {
                let p = random_packed(format, m, k, 300 + 10 * fi as u64 + i as u64);
                b.upload(host(&format!("layers.0.attn.w{i}.weight"), m, k, &p)).unwrap()
            })
            .collect();
        let (x, _) = activations(&b, 1, k, 310 + fi as u64);
        b.set_gemv4(false);
        b.set_x8_group(false);
        let alone: Vec<Vec<f32>> = ws.iter().map(|w| b.to_host(&b.matmul(&x, w))).collect();
        // Four outputs a warp (k = 512 ≤ 1024: gemv1x4, gemv1xg4) change no sum either.
        b.set_gemv4(true);
        assert!(ws.iter().all(|w| b.gemv4_fits(k, w.rows)), "the four-output kernels apply to these shapes");
        for (i, w) in ws.iter().enumerate() {
            for (o, (v, a)) in b.to_host(&b.matmul(&x, w)).iter().zip(&alone[i]).enumerate() {
                assert_eq!(v.to_bits(), a.to_bits(), "{} gemv1x4: product {i} output {o}: {v} vs {a}", format.name());
            }
        }
        // The first n products of x in one launch (the grouped path, and matmul_many with the
        // switch on), each bitwise its product alone.
        let grouped_each_alone = |x: &CudaTensor, n: usize, alone: &[Vec<f32>]| {
            let refs: Vec<&CudaWeight> = ws[..n].iter().collect();
            let grouped = b.matmul_grouped_x8(x, &refs).expect("one format, 1-4 rows: the grouped path applies");
            b.set_x8_group(true);
            let many = b.matmul_many(x, &refs);
            b.set_x8_group(false);
            for (i, (g, m)) in grouped.iter().zip(&many).enumerate() {
                for (what, t) in [("grouped", g), ("matmul_many", m)] {
                    for (o, (v, a)) in b.to_host(t).iter().zip(&alone[i]).enumerate() {
                        assert_eq!(
                            v.to_bits(),
                            a.to_bits(),
                            "{} {what} of {n}, {} rows: product {i} output {o}: {v} vs alone {a}",
                            format.name(),
                            x.rows
                        );
                    }
                }
            }
        };
        for (n, four) in (2..=4).flat_map(|n| [(n, false), (n, true)]) {
            b.set_gemv4(four);
            grouped_each_alone(&x, n, &alone);
        }
        b.set_gemv4(false);
        // 2 and 4 rows (a verify's), two outputs a warp (gemvxg4p): each bitwise its product alone.
        b.set_row_caps(true);
        b.set_row_pairs(true);
        for rows in [2, 4] {
            let (xr, _) = activations(&b, rows, k, 330 + 10 * fi as u64 + rows as u64);
            let alone: Vec<Vec<f32>> = ws.iter().map(|w| b.to_host(&b.matmul(&xr, w))).collect();
            for n in 2..=4 {
                grouped_each_alone(&xr, n, &alone);
            }
        }
        println!(
            "int8 {}: 2 to 4 products in one launch (1, 2 and 4 rows), and 4 outputs a warp, bitwise each alone",
            format.name()
        );
    }
    b.set_int8(false);
}

/// The grouped product that writes its output's int8 codes (`set_gemv_twin`: wo_a's, read by
/// wo_b; `gemv1xq` at one row, `gemvx2pq` / `gemvx4pq` at 2–4) gives bitwise the plain
/// product, and the next product on its codes is bitwise the product on a copy of its values
/// (quantised by that product itself): wo_a's shape at 2 groups × 128 outputs (8 groups of 32
/// values, each finished by the last of 4 blocks at one row, of 2 at 2–4 rows), run three times
/// (the counters must be left zero), each int8 format, 1 to 4 rows.
#[test]
fn cuda_one_row_product_with_its_output_codes_is_bitwise() {
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    b.set_int8(true);
    b.set_row_caps(true);
    b.set_row_pairs(true);
    let k = 256;
    for (fi, format) in [PackedFormat::Q8_0, PackedFormat::Q2_K, PackedFormat::IQ2_XXS].into_iter().enumerate() {
        let pa = random_packed(format, 256, k, 400 + fi as u64);
        let wa = b.upload(host("layers.0.attn.wo_a.weight", 256, k, &pa)).unwrap();
        let pb = random_packed(format, 32, 256, 410 + fi as u64);
        let wb = b.upload(host("layers.0.attn.wo_b.weight", 32, 256, &pb)).unwrap();
        for n in 1..=4 {
            let (x, _) = activations(&b, n, 2 * k, 420 + fi as u64 + 7 * n as u64);
            b.set_gemv_twin(false);
            let plain = b.to_host(&b.grouped_matmul(&x, &wa, 2));
            for run in 0..3 {
                b.set_gemv_twin(true);
                let z = b.grouped_matmul(&x, &wa, 2);
                b.set_gemv_twin(false);
                let what = format!("{} at {n} rows, run {run}", format.name());
                assert!(b.has_x8_twin(&z), "{what}: the product wrote no codes");
                for (o, (g, p)) in b.to_host(&z).iter().zip(&plain).enumerate() {
                    assert_eq!(g.to_bits(), p.to_bits(), "{what}: output {o}: {g} vs {p}");
                }
                let copy = b.upload(HostTensor::new("z", vec![n, 256], b.to_host(&z))).unwrap();
                let (on_codes, on_copy) =
                    (b.to_host(&b.matmul(&z, &wb)), b.to_host(&b.matmul(&CudaTensor::new(n, 256, copy.data), &wb)));
                for (o, (a, c)) in on_codes.iter().zip(&on_copy).enumerate() {
                    assert_eq!(a.to_bits(), c.to_bits(), "{what}: next product output {o}: {a} vs {c}");
                }
            }
        }
        println!("int8 {}: 1-4-row products with their outputs' codes bitwise, their codes quant_x8's", format.name());
    }
    b.set_int8(false);
}

/// Row `r` of `t` as a one-row device tensor.
fn row_of(b: &CudaBackend, t: &Tensor, r: usize) -> CudaTensor {
    let h = HostTensor::new("row", vec![1, t.cols], t.data[r * t.cols..(r + 1) * t.cols].to_vec());
    CudaTensor::new(1, t.cols, b.upload(h).unwrap().data)
}

/// Synthetic packed weights drawn on the device dequantise to finite values of about the
/// requested size (what `dsv4 bench --synthetic flash --experts q2` relies on), download as
/// valid blocks (IQ2_XXS: `Planes::join` refuses sign words GGUF cannot hold), and the device
/// product equals the product with the downloaded blocks' CPU values.
#[test]
fn cuda_random_packed_weights_are_sane() {
    let Some(b) = gpu() else { return };
    b.set_exact(true);
    for format in PackedFormat::ALL {
        let w = b.upload_random_packed(format, 64, 1024, 0.03, 7);
        let (x, xt) = activations(&b, 1, 1024, 3);
        let y = b.to_host(&b.matmul(&x, &w));
        let rms = (y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / y.len() as f64).sqrt();
        // x ~ U(-1, 1): |x|² ≈ 1024/3, so y's RMS ≈ 0.03·√(1024/3) ≈ 0.55.
        println!("{}: output RMS {rms:.3}", format.name());
        assert!(y.iter().all(|v| v.is_finite()) && (0.1..3.0).contains(&rms), "{}: RMS {rms}", format.name());
        let vals = b.download_packed(&w).expect("packed").dequantize(64, 1024);
        for (o, &g) in y.iter().enumerate() {
            let e: f64 = (0..1024).map(|c| xt.data[c] as f64 * vals[o * 1024 + c] as f64).sum();
            assert!((g as f64 - e).abs() < 1e-4 * (1.0 + e.abs()), "{} output {o}: {g} vs {e}", format.name());
        }
    }
}

/// The fused q/kv RMSNorm with RoPE is bitwise the norm and then the RoPE (two heads a row,
/// rows at scattered positions, with and without a norm weight).
#[test]
fn cuda_norm_rope_is_norm_then_rope() {
    let Some(b) = gpu() else { return };
    let (head, heads) = (512, 2);
    let batch = dsv4_backend::Batch::chunk(0, 4090, &[1, 2, 3]).unwrap();
    let rows = b.rows(&batch);
    let freqs: Vec<f64> = (0..32).map(|i| 10000f64.powf(-(i as f64) / 32.0)).collect();
    let (x, _) = activations(&b, 3, heads * head, 3);
    let (_, nw) = activations(&b, 1, head, 4);
    let nw = b.upload(HostTensor::new("layers.0.attn.kv_norm.weight", vec![head], nw.data)).unwrap();
    for w in [None, Some(&nw)] {
        let fused = b.to_host(&b.rms_norm_rope(&x, w, head, 1e-6, &rows, &freqs));
        let mut plain = b.rms_norm(&x, w, head, 1e-6);
        b.rope(&mut plain, &rows, &freqs, head, false);
        let plain = b.to_host(&plain);
        for (i, (f, p)) in fused.iter().zip(&plain).enumerate() {
            assert_eq!(f.to_bits(), p.to_bits(), "norm+rope value {i} (weight {}): {f} vs {p}", w.is_some());
        }
    }
}

/// The attention norms and rotations in two launches (`set_norm_group`, `norm_many`) are
/// bitwise each op's own launch at V4-Flash widths, int8 twins included: q_a's 1024-wide norm
/// (256 threads) with kv's 512-wide norm + RoPE (128 threads: the launch's block idles two
/// warps for it), then 64 heads' norm + RoPE with the indexer query's RoPE (64 heads of 128).
/// The twins are compared through Q8_0 products, which read them.
#[test]
fn cuda_attention_norms_in_two_launches_are_bitwise() {
    use dsv4_backend::backend::NormJob;
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    b.set_int8(true);
    let (d, ql, heads, ih) = (512usize, 1024usize, 64usize, 128usize);
    let wq =
        b.upload(host("layers.0.attn.wq_b.weight", 64, ql, &random_packed(PackedFormat::Q8_0, 64, ql, 6))).unwrap();
    let wkv = b.upload(host("layers.0.attn.wo_x.weight", 64, d, &random_packed(PackedFormat::Q8_0, 64, d, 7))).unwrap();
    let freqs: Vec<f64> = (0..32).map(|i| 10000f64.powf(-(i as f64) / 32.0)).collect();
    let norm_w = |name: &str, n: usize, seed: u64| {
        let (_, t) = activations(&b, 1, n, seed);
        b.upload(HostTensor::new(name, vec![n], t.data)).unwrap()
    };
    let (qn, kvn) = (norm_w("layers.0.attn.q_norm.weight", ql, 8), norm_w("layers.0.attn.kv_norm.weight", d, 9));
    for n in [1usize, 3, 8] {
        let toks: Vec<u32> = (0..n as u32).collect();
        let batch = dsv4_backend::Batch::chunk(0, 4090, &toks).unwrap();
        let rows = b.rows(&batch);
        let (q_a, _) = activations(&b, n, ql, 10);
        let (kv_a, _) = activations(&b, n, d, 11);
        let (qh, _) = activations(&b, n, heads * d, 12);
        let run = |on: bool| -> Vec<Vec<f32>> {
            b.set_norm_group(on);
            let a = b.norms(
                vec![
                    NormJob::Norm { x: &q_a, w: Some(&qn), group: ql, eps: 1e-6, rope: false },
                    NormJob::Norm { x: &kv_a, w: Some(&kvn), group: d, eps: 1e-6, rope: true },
                ],
                &rows,
                &freqs,
            );
            let (qi, _) = activations(&b, n, heads * ih, 13);
            let c = b.norms(
                vec![
                    NormJob::Norm { x: &qh, w: None, group: d, eps: 1e-6, rope: true },
                    NormJob::Rope { x: qi, head: ih },
                ],
                &rows,
                &freqs,
            );
            let prods = [b.matmul(&a[0], &wq), b.matmul(&a[1], &wkv)];
            a.iter().chain(&c).chain(&prods).map(|t| b.to_host(t)).collect()
        };
        let (apart, fused) = (run(false), run(true));
        b.set_norm_group(false);
        let names = [
            "q_a's norm",
            "kv's norm + RoPE",
            "the heads' norm + RoPE",
            "the indexer query's RoPE",
            "q_a's twin",
            "kv's twin",
        ];
        for ((name, p), f) in names.iter().zip(&apart).zip(&fused) {
            let bad = p.iter().zip(f).position(|(p, f)| p.to_bits() != f.to_bits());
            assert!(bad.is_none(), "{n} rows, {name}: value {bad:?} differs from its own launch");
        }
    }
    b.set_int8(false);
}

/// The router's product with its choice of experts in one launch (`set_route_fused`,
/// `gemv_route`) is bitwise the product and then `route`, at V4-Flash widths (256 experts of
/// 4096, top 6): learned routing (score + bias) and hash routing (`tid2eid` at the rows'
/// tokens), 1 to 8 rows.
#[test]
fn cuda_router_in_one_launch_is_bitwise() {
    let Some(b) = gpu() else { return };
    b.set_exact(true);
    let (e, k, top, vocab) = (256usize, 4096usize, 6usize, 512usize);
    let mut cfg = dsv4_model::synth::tiny_config(64);
    cfg.n_experts_per_tok = top;
    let (_, gw) = activations(&b, e, k, 20);
    let gate = b.upload(HostTensor::new("layers.0.ffn.gate.weight", vec![e, k], gw.data)).unwrap();
    let (_, bw) = activations(&b, 1, e, 21);
    let bias = b.upload(HostTensor::new("layers.0.ffn.gate.bias", vec![e], bw.data)).unwrap();
    let mut r = ChaCha8Rng::seed_from_u64(22);
    let table: Vec<u32> = (0..vocab * top).map(|_| r.gen_range(0..e as u32)).collect();
    for n in [1usize, 2, 5, 8] {
        let toks: Vec<u32> = (0..n).map(|i| (i * 97 + 5) as u32 % vocab as u32).collect();
        let batch = dsv4_backend::Batch::chunk(0, 100, &toks).unwrap();
        let rows = b.rows(&batch);
        let (x, _) = activations(&b, n, k, 23 + n as u64);
        for hash in [false, true] {
            let run = |on: bool| {
                b.set_route_fused(on);
                let h = hash.then(|| (&table[..], &rows));
                let (logits, route) = b.router(&x, &gate, (!hash).then_some(&bias), h, &cfg);
                (b.to_host(&logits), b.download(&route.ids), b.download(&route.weights))
            };
            let (apart, fused) = (run(false), run(true));
            b.set_route_fused(false);
            let what = if hash { "hash" } else { "learned" };
            assert!(apart.0.iter().zip(&fused.0).all(|(p, f)| p.to_bits() == f.to_bits()), "{n} rows, {what}: logits");
            assert_eq!(apart.1, fused.1, "{n} rows, {what}: expert ids");
            assert!(apart.2.iter().zip(&fused.2).all(|(p, f)| p.to_bits() == f.to_bits()), "{n} rows, {what}: weights");
            assert!(apart.2.iter().all(|w| w.is_finite() && *w > 0.0), "{n} rows, {what}: routing weights");
        }
    }
}

/// A tiny config of `d`-wide hidden states in 4 mHC streams, with random HC_PRE weights and
/// norm weight for one sub-block.
fn hc_sub_block(b: &CudaBackend, d: usize) -> (dsv4_model::Config, dsv4_model::weights::Hc<CudaWeight>, CudaWeight) {
    hc_sub_block_seeded(b, d, 0)
}

/// [`hc_sub_block`] with its random weights drawn from seeds offset by `seed`.
fn hc_sub_block_seeded(
    b: &CudaBackend,
    d: usize,
    seed: u64,
) -> (dsv4_model::Config, dsv4_model::weights::Hc<CudaWeight>, CudaWeight) {
    let mut cfg = dsv4_model::synth::tiny_config(64);
    cfg.hidden = d;
    cfg.hc_mult = 4;
    let n = cfg.hc_mult;
    let mix = (2 + n) * n;
    let up = |name: &str, shape: Vec<usize>, seed: u64, scale: f32| {
        let (_, t) = activations(b, 1, shape.iter().product(), seed);
        b.upload(HostTensor::new(name, shape, t.data.iter().map(|v| v * scale).collect())).unwrap()
    };
    let hc = dsv4_model::weights::Hc {
        fn_: up("layers.0.hc_attn_fn", vec![mix, n * d], seed + 1, 0.05),
        base: up("layers.0.hc_attn_base", vec![mix], seed + 2, 1.0),
        scale: up("layers.0.hc_attn_scale", vec![3], seed + 3, 1.0),
    };
    let norm = up("layers.0.attn_norm.weight", vec![d], seed + 4, 1.0);
    (cfg, hc, norm)
}

/// HC_PRE with the sub-block's RMSNorm in one launch is bitwise HC_PRE and then the norm, at
/// V4-Flash's width (4 streams of 4096) for one row and for three, and each row alone is
/// bitwise that row among the three.
#[test]
fn cuda_hc_pre_norm_is_hc_pre_then_norm() {
    let Some(b) = gpu() else { return };
    let (cfg, hc, norm) = hc_sub_block(&b, 4096);
    let (n, d) = (cfg.hc_mult, cfg.hidden);
    let (x3, xc) = activations(&b, 3, n * d, 5);
    let host = |t: &CudaTensor| b.to_host(t);
    let bitwise = |a: &[f32], c: &[f32], what: &str| {
        assert_eq!(a.len(), c.len(), "{what}: lengths");
        for (i, (p, q)) in a.iter().zip(c).enumerate() {
            assert_eq!(p.to_bits(), q.to_bits(), "{what}: value {i}: {p} vs {q}");
        }
    };
    let (y, a, post, comb) = b.hc_pre_norm(&x3, &hc, &norm, &cfg);
    let (y2, post2, comb2) = b.hc_pre(&x3, &hc, &cfg);
    let a2 = b.rms_norm(&y2, Some(&norm), d, cfg.rms_eps);
    for (p, q, what) in [(&y, &y2, "y"), (&a, &a2, "norm"), (&post, &post2, "post"), (&comb, &comb2, "comb")] {
        bitwise(&host(p), &host(q), what);
    }
    let (ha, hy) = (host(&a), host(&y));
    assert!(ha.iter().all(|v| v.is_finite()) && ha.iter().any(|v| *v != 0.0), "norm values");
    for r in 0..3 {
        let (y1, a1, _, _) = b.hc_pre_norm(&row_of(&b, &xc, r), &hc, &norm, &cfg);
        bitwise(&host(&y1), &hy[r * d..(r + 1) * d], "y, a row alone");
        bitwise(&host(&a1), &ha[r * d..(r + 1) * d], "norm, a row alone");
    }
}

/// HC_POST that forms the next HC_PRE's sums beside the streams (`set_hc_post_dot`) gives
/// bitwise HC_POST's streams, and the HC_PRE on them bitwise the one that forms its own sums:
/// 1 and 5 rows (row groups of 4: a full and a partial one) in fast mode, 300 rows in exact
/// mode (fast mode's prefill kernels there: the streams then carry no sums).
#[test]
fn cuda_hc_post_with_the_next_sums_is_bitwise() {
    let Some(b) = gpu() else { return };
    let (cfg, hc, norm) = hc_sub_block(&b, 4096);
    let (n, d) = (cfg.hc_mult, cfg.hidden);
    let host = |t: &CudaTensor| b.to_host(t);
    for (rows, exact) in [(1, false), (5, false), (300, true), (300, false)] {
        b.set_exact(exact);
        let (x, _) = activations(&b, rows, n * d, 20 + rows as u64);
        let (f, _) = activations(&b, rows, d, 21 + rows as u64);
        let (_, _, post, comb) = b.hc_pre_norm(&x, &hc, &norm, &cfg);
        b.set_hc_post_dot(false);
        let plain = b.hc_post(&f, &x, &post, &comb);
        let want = b.hc_pre_norm(&plain, &hc, &norm, &cfg);
        b.set_hc_post_dot(true);
        let fused = b.hc_post_next(&f, &x, &post, &comb, &hc, &cfg);
        b.set_hc_post_dot(false);
        let carries = rows < 256 || exact;
        assert_eq!(fused.carries_hc_sums(), carries, "{rows} rows (exact {exact}): sums kept beside the streams");
        let got = b.hc_pre_norm(&fused, &hc, &norm, &cfg);
        // Sums kept for one fn weight are not used for another: that HC_PRE forms its own.
        let (_, other, _) = hc_sub_block_seeded(&b, 4096, 50);
        let (o_got, o_want) = (b.hc_pre_norm(&fused, &other, &norm, &cfg), b.hc_pre_norm(&plain, &other, &norm, &cfg));
        let pairs = [
            (&o_got.1, &o_want.1, "another fn's norm"),
            (&o_got.2, &o_want.2, "another fn's post"),
            (&fused, &plain, "streams"),
            (&got.0, &want.0, "y"),
            (&got.1, &want.1, "norm"),
            (&got.2, &want.2, "post"),
            (&got.3, &want.3, "comb"),
        ];
        for (p, q, what) in pairs {
            for (i, (u, v)) in host(p).iter().zip(&host(q)).enumerate() {
                assert_eq!(u.to_bits(), v.to_bits(), "{rows} rows (exact {exact}), {what}: value {i}: {u} vs {v}");
            }
        }
        println!("{rows} rows (exact {exact}): HC_POST with the next sums bitwise HC_POST, then HC_PRE (sums kept: {carries})");
    }
    b.set_exact(false);
}

/// Prefill-sized HC_PRE in fast mode (300 rows: `hc_pre_dot_rows`'s 16-byte slices, and the
/// fused launch with post and comb from `hc_pre_sink_rows`, a warp a row): the fused launch is
/// bitwise HC_PRE then the norm, and HC_PRE is the exact path's within f32 reordering (the
/// partial sums of 16,384 products each: 1e-5 of the values' scale, where a wrong slice or row
/// would be off by the values themselves).
#[test]
fn cuda_hc_pre_of_prefill_rows() {
    let Some(b) = gpu() else { return };
    let (cfg, hc, norm) = hc_sub_block(&b, 4096);
    let (n, d, rows) = (cfg.hc_mult, cfg.hidden, 300);
    let (x, _) = activations(&b, rows, n * d, 9);
    let host = |t: &CudaTensor| b.to_host(t);
    b.set_exact(false);
    let (y, a, post, comb) = b.hc_pre_norm(&x, &hc, &norm, &cfg);
    let (y2, post2, comb2) = b.hc_pre(&x, &hc, &cfg);
    let a2 = b.rms_norm(&y2, Some(&norm), d, cfg.rms_eps);
    for (p, q, what) in [(&y, &y2, "y"), (&a, &a2, "norm"), (&post, &post2, "post"), (&comb, &comb2, "comb")] {
        let (p, q) = (host(p), host(q));
        assert_eq!(p.len(), q.len(), "{what}: lengths");
        for (i, (u, v)) in p.iter().zip(&q).enumerate() {
            assert_eq!(u.to_bits(), v.to_bits(), "{what}: value {i}: {u} vs {v}");
        }
    }
    b.set_exact(true);
    let (y3, post3, comb3) = b.hc_pre(&x, &hc, &cfg);
    for (p, q, what) in [(&y, &y3, "y"), (&post, &post3, "post"), (&comb, &comb3, "comb")] {
        let (p, q) = (host(p), host(q));
        let scale = q.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0 && p.iter().all(|v| v.is_finite()), "{what}: values");
        for (i, (u, v)) in p.iter().zip(&q).enumerate() {
            assert!((u - v).abs() <= 1e-5 * scale, "{what}: value {i}: fast {u} vs exact {v} (scale {scale})");
        }
    }
}

/// The prefill-sized launches that promise bitwise the small ones' values: the q norm with RoPE
/// over 80 rows × 64 heads of 512 (`rms_norm_warp`, a warp a head) against the same rows in
/// chunks of 16 (`rms_norm`, a block a head), and HC_POST over 300 rows (`hc_post4`, 16-byte
/// accesses) against single rows (`hc_post`).
#[test]
fn cuda_prefill_sized_norm_and_hc_post_are_bitwise() {
    let Some(b) = gpu() else { return };
    let bitwise = |a: &[f32], c: &[f32], what: &str| {
        assert_eq!(a.len(), c.len(), "{what}: lengths");
        for (i, (p, q)) in a.iter().zip(c).enumerate() {
            assert_eq!(p.to_bits(), q.to_bits(), "{what}: value {i}: {p} vs {q}");
        }
    };
    let (head, heads, rows) = (512, 64, 80);
    let freqs: Vec<f64> = (0..32).map(|i| 10000f64.powf(-(i as f64) / 32.0)).collect();
    let toks: Vec<u32> = (0..rows as u32).collect();
    let (x, xc) = activations(&b, rows, heads * head, 11);
    let all = b.rows(&dsv4_backend::Batch::chunk(0, 4000, &toks).unwrap());
    let many = b.to_host(&b.rms_norm_rope(&x, None, head, 1e-6, &all, &freqs));
    assert!(many.iter().all(|v| v.is_finite()), "norm values");
    for r0 in (0..rows).step_by(16) {
        let part = b.rows(&dsv4_backend::Batch::chunk(0, 4000 + r0, &toks[r0..r0 + 16]).unwrap());
        let h =
            HostTensor::new("x", vec![16, heads * head], xc.data[r0 * heads * head..(r0 + 16) * heads * head].to_vec());
        let xs = CudaTensor::new(16, heads * head, b.upload(h).unwrap().data);
        let few = b.to_host(&b.rms_norm_rope(&xs, None, head, 1e-6, &part, &freqs));
        bitwise(&many[r0 * heads * head..(r0 + 16) * heads * head], &few, "q norm with RoPE, rows in chunks of 16");
    }
    let (n, d, rows) = (4, 4096, 300);
    let (f, fc) = activations(&b, rows, d, 12);
    let (xs, xsc) = activations(&b, rows, n * d, 13);
    let (post, pc) = activations(&b, rows, n, 14);
    let (comb, cc) = activations(&b, rows, n * n, 15);
    let got = b.to_host(&b.hc_post(&f, &xs, &post, &comb));
    for r in [0, 131, 299] {
        let one =
            b.to_host(&b.hc_post(&row_of(&b, &fc, r), &row_of(&b, &xsc, r), &row_of(&b, &pc, r), &row_of(&b, &cc, r)));
        bitwise(&got[r * n * d..(r + 1) * n * d], &one, "hc_post, a row alone");
    }
}

/// The inverse RoPE of a prefill chunk's attention output with its bf16 copy in one pass
/// (`rope_cast`, 300 rows × 64 heads of 512) is bitwise `rope` over the same rows in chunks of
/// 100 (below its row threshold), and the wo_a-style product that reads the kept copy is bitwise
/// the product of the rotated values uploaded again (cast afresh by `cast_bf16`).
#[test]
fn cuda_prefill_rope_with_its_bf16_copy_is_bitwise() {
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    let (head, heads, rows) = (512, 64, 300);
    let cols = head * heads;
    let freqs: Vec<f64> = (0..32).map(|i| 10000f64.powf(-(i as f64) / 32.0)).collect();
    let toks: Vec<u32> = (0..rows as u32).collect();
    let (mut x, xc) = activations(&b, rows, cols, 21);
    let all = b.rows(&dsv4_backend::Batch::chunk(0, 7000, &toks).unwrap());
    b.rope(&mut x, &all, &freqs, head, true);
    let got = b.to_host(&x);
    for r0 in (0..rows).step_by(100) {
        let part = b.rows(&dsv4_backend::Batch::chunk(0, 7000 + r0, &toks[r0..r0 + 100]).unwrap());
        let h = HostTensor::new("x", vec![100, cols], xc.data[r0 * cols..(r0 + 100) * cols].to_vec());
        let mut xs = CudaTensor::new(100, cols, b.upload(h).unwrap().data);
        b.rope(&mut xs, &part, &freqs, head, true);
        let want = b.to_host(&xs);
        for (i, (p, q)) in got[r0 * cols..(r0 + 100) * cols].iter().zip(&want).enumerate() {
            assert_eq!(p.to_bits(), q.to_bits(), "inverse RoPE, rows {r0}..: value {i}: {p} vs {q}");
        }
    }
    // Two groups of 16 outputs, each over half the row (wo_a's grouped shape).
    let (m, groups) = (32, 2);
    let mut r = ChaCha8Rng::seed_from_u64(22);
    let w: Vec<f32> =
        (0..m * cols / groups).map(|_| dsv4_backend::bf16::round_bf16(r.gen_range(-0.1f32..0.1))).collect();
    let wt = b.upload(HostTensor::new("layers.0.attn.wo_a.weight", vec![m, cols / groups], w)).unwrap();
    let kept = b.to_host(&b.grouped_matmul(&x, &wt, groups));
    let again = CudaTensor::new(rows, cols, b.upload(HostTensor::new("x", vec![rows, cols], got)).unwrap().data);
    let fresh = b.to_host(&b.grouped_matmul(&again, &wt, groups));
    for (i, (p, q)) in kept.iter().zip(&fresh).enumerate() {
        assert_eq!(p.to_bits(), q.to_bits(), "product of the kept bf16 copy: output {i}: {p} vs {q}");
    }
}

/// In int8 mode the fused HC_PRE + norm writes the norm's int8 twin (`quant4_block32` in hc.cu):
/// a product on its output is bitwise the product on a copy of the values (quantised by the
/// product itself, `quant_block32`), and the values are bitwise HC_PRE then `rms_norm`. At
/// V4-Flash's width (d = 4 × the block's 1024 threads) and at d = 96 (32 threads, a thread's
/// fourth column out of the row).
#[test]
fn cuda_hc_pre_norm_twin_is_the_norms_codes() {
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    b.set_int8(true);
    for d in [4096usize, 96] {
        let (cfg, hc, norm) = hc_sub_block(&b, d);
        let n = cfg.hc_mult;
        // A Q8_0 weight: with one uploaded, whole-row norms write the twin.
        let m = 40;
        let w = b.upload(host("layers.0.attn.wq_a.weight", m, d, &random_packed(PackedFormat::Q8_0, m, d, 6))).unwrap();
        for rows in [1, 3] {
            let (x, _) = activations(&b, rows, n * d, 5 + rows as u64);
            let (_, a, _, _) = b.hc_pre_norm(&x, &hc, &norm, &cfg);
            let (y2, _, _) = b.hc_pre(&x, &hc, &cfg);
            let a2 = b.to_host(&b.rms_norm(&y2, Some(&norm), d, cfg.rms_eps));
            let ha = b.to_host(&a);
            assert!(ha.iter().zip(&a2).all(|(p, q)| p.to_bits() == q.to_bits()), "d {d}, {rows} rows: norm values");
            let copy = b.upload(HostTensor::new("a", vec![rows, d], ha)).unwrap();
            let (p, q) = (b.to_host(&b.matmul(&a, &w)), b.to_host(&b.matmul(&CudaTensor::new(rows, d, copy.data), &w)));
            assert!(p.iter().zip(&q).all(|(p, q)| p.to_bits() == q.to_bits()), "d {d}, {rows} rows: twin");
        }
    }
    b.set_int8(false);
}

/// bf16 products of up to `bf16::GEMV_ROWS` rows give each row bitwise its one-row result: in
/// fast mode on the tensor-core tiles (`gemvt_bf16`) where the shapes allow and on the GEMV
/// kernel where not, in exact mode on the GEMV kernel (any row count). Against the f64 product
/// on the bf16 weights: exact mode (f32 activations) within 1e-5 of the output's scale, fast
/// mode (activations rounded to bf16, 2^-9 relative each) within 1e-2.
#[test]
fn cuda_bf16_products_are_row_invariant() {
    let Some(b) = gpu() else { return };
    let mut r = ChaCha8Rng::seed_from_u64(11);
    // (m, k, groups): a partial 16-output tile (44 outputs, one group); a grouped projection of
    // 32 outputs a group (tiles); one of k = 264 (not a multiple of 32: the GEMV kernel); k =
    // 3,328: a warp's k blocks in four batches of 4, the last partial (gemvtp_bf16's two
    // buffers, DSV4_GEMVT_PIPE=1), against 16 rows (gemvt16_bf16, never pipelined); k = 2,304:
    // three batches (an odd count, the last in the first buffer); k = 160: warps with no block.
    for (m, k, groups) in
        [(44usize, 512usize, 1usize), (64, 256, 2), (44, 264, 2), (40, 3328, 1), (40, 2304, 1), (40, 160, 1)]
    {
        let w: Vec<f32> = (0..m * k).map(|_| dsv4_backend::bf16::round_bf16(r.gen_range(-0.1f32..0.1))).collect();
        let wt = b.upload(HostTensor::new("layers.0.attn.wq.weight", vec![m, k], w.clone())).unwrap();
        for (exact, n) in [(false, 1usize), (false, 3), (false, 16), (true, 21)] {
            b.set_exact(exact);
            let (x, xc) = activations(&b, n, groups * k, 5 + n as u64);
            let y = if groups == 1 { b.matmul(&x, &wt) } else { b.grouped_matmul(&x, &wt, groups) };
            let y = b.to_host(&y);
            let want = reference(&xc, &w, m, k, groups);
            let e = rel_err(&y, &want);
            let tol = if exact { 1e-5 } else { 1e-2 };
            println!("bf16 [{m}, {k}] x{groups}, {n} rows (exact {exact}): error {e:.2e}");
            assert!(e < tol, "bf16 [{m}, {k}] x{groups}, {n} rows (exact {exact}): error {e}");
            for row in 0..n {
                let xr = row_of(&b, &xc, row);
                let one = if groups == 1 { b.matmul(&xr, &wt) } else { b.grouped_matmul(&xr, &wt, groups) };
                let one = b.to_host(&one);
                for (i, (a, g)) in one.iter().zip(&y[row * m..(row + 1) * m]).enumerate() {
                    assert_eq!(a.to_bits(), g.to_bits(), "bf16 [{m}, {k}] x{groups}: row {row} of {n}, output {i}");
                }
            }
        }
    }
    b.set_exact(true);
}

/// Several bf16 products of one input in one launch (`Backend::matmul_many`, the attention
/// input's compressor and indexer projections) are bitwise each product alone: in fast mode
/// (tensor-core tiles) at 1, 3 and 16 rows and in exact mode (the GEMV kernels) at 1 and 21,
/// with a packed weight among them (run on its own) and shapes that end mid-tile.
#[test]
fn cuda_bf16_products_in_one_launch_are_each_alone() {
    let Some(b) = gpu() else { return };
    let mut r = ChaCha8Rng::seed_from_u64(12);
    let k = 512;
    let mut ws = Vec::new();
    for (i, m) in [64usize, 44, 1024, 8, 200].into_iter().enumerate() {
        let w: Vec<f32> = (0..m * k).map(|_| dsv4_backend::bf16::round_bf16(r.gen_range(-0.1f32..0.1))).collect();
        ws.push(b.upload(HostTensor::new(format!("layers.0.attn.w{i}.weight"), vec![m, k], w)).unwrap());
    }
    let packed = b.upload_random_packed(PackedFormat::Q8_0, 96, k, 0.03, 9);
    let all: Vec<_> = ws.iter().take(2).chain([&packed]).chain(ws.iter().skip(2)).collect();
    for (exact, n) in [(false, 1usize), (false, 3), (false, 16), (true, 1), (true, 21)] {
        b.set_exact(exact);
        let (x, _) = activations(&b, n, k, 40 + n as u64);
        let many = b.matmul_many(&x, &all);
        assert_eq!(many.len(), all.len());
        for (j, (w, got)) in all.iter().zip(&many).enumerate() {
            let (got, alone) = (b.to_host(got), b.to_host(&b.matmul(&x, w)));
            assert_eq!(got.len(), alone.len(), "product {j}: shape");
            for (i, (p, q)) in got.iter().zip(&alone).enumerate() {
                assert_eq!(p.to_bits(), q.to_bits(), "product {j}, {n} rows (exact {exact}), value {i}: {p} vs {q}");
            }
        }
    }
    b.set_exact(true);
}

/// The tensor-core tiles for many rows (gemm.cu: prefill chunks, decode batches above the int8
/// path's rows) against their twin: the weights dequantised and the activations rounded to bf16
/// (as the tiles do), summed in f64. The tiles' f32 sums differ from it only in the order of the
/// additions: ≤ 1e-5 of the output's scale for the products (k ≤ 1024). Routed experts also
/// round h = SwiGLU(gate, up) to bf16, where the f32 gate and up (~1e-6 from the twin's) can move
/// a rounding by one bf16 step (2^-8 of that term) in a few of the 256 terms of a down sum, each
/// about 2^-8 / √256 ≈ 2.4e-4 of the output's scale (1.2e-4 measured on the H200): ≤ 1e-3,
/// still 20× below the 2e-2 that bounds the bf16 path against the exact product.
#[test]
fn cuda_prefill_tiles_match_the_bf16_twin() {
    use dsv4_backend::bf16::round_bf16;
    let Some(b) = gpu() else { return };
    b.set_exact(false);
    b.set_tiles_dense_rows(usize::MAX);
    let rb = |v: &[f32]| v.iter().map(|&x| round_bf16(x)).collect::<Vec<f32>>();
    for (fi, format) in PackedFormat::ALL.into_iter().enumerate() {
        // 300 rows: two full row tiles of 128 and a partial one; m = 384: three output tiles.
        let (m, k, n) = (384, 1024, 300);
        let p = random_packed(format, m, k, 300 + fi as u64);
        let w = b.upload(host("layers.0.attn.wq_a.weight", m, k, &p)).unwrap();
        assert!(w.q.is_some(), "{} kept packed", format.name());
        let wf = rb(&p.dequantize(m, k));
        let (xg, xc) = activations(&b, n, k, 310 + fi as u64);
        let got = b.to_host(&b.matmul(&xg, &w));
        let e = rel_err(&got, &reference(&Tensor::new(n, k, rb(&xc.data)), &wf, m, k, 1));
        println!("tiles {} {n} rows: {e:.2e} from the bf16 twin", format.name());
        assert!(e <= 1e-5, "tiles {} product, {n} rows: {e:.2e} from the bf16 twin", format.name());
        // The same product's first 40 rows alone (tiles of 64 rows; k split in 4 either way, by
        // the shape): bitwise the 300-row result's rows, as a decode batch needs.
        let (x40, _) = activations(&b, 40, k, 310 + fi as u64);
        let few = b.to_host(&b.matmul(&x40, &w));
        for (i, (p, q)) in few.iter().zip(&got[..40 * m]).enumerate() {
            assert_eq!(p.to_bits(), q.to_bits(), "tiles {} 40 rows vs 300, value {i}: {p} vs {q}", format.name());
        }
        // The grouped projection (wo_a): two groups of 256 outputs, each over its own k inputs.
        let pg = random_packed(format, 512, k, 320 + fi as u64);
        let wg = b.upload(host("layers.0.attn.wo_a.weight", 512, k, &pg)).unwrap();
        let (xg, xc) = activations(&b, 70, 2 * k, 330 + fi as u64);
        let got = b.to_host(&b.grouped_matmul(&xg, &wg, 2));
        let want = reference(&Tensor::new(70, 2 * k, rb(&xc.data)), &rb(&pg.dequantize(512, k)), 512, k, 2);
        let e = rel_err(&got, &want);
        assert!(e <= 1e-5, "tiles {} grouped product: {e:.2e} from the bf16 twin", format.name());
    }
    let cpu = CpuBackend;
    let (d, inter, ne) = (256, 256, 8);
    let pairs = [
        (PackedFormat::IQ2_XXS, PackedFormat::Q2_K),
        (PackedFormat::Q4_K, PackedFormat::Q4_K),
        (PackedFormat::Fp4, PackedFormat::Fp4),
        (PackedFormat::Q8_0, PackedFormat::Fp8),
    ];
    for (pi, (f13, f2)) in pairs.into_iter().enumerate() {
        let (gpu_e, cpu_e) = random_experts(&b, (f13, f2), (d, inter, ne), 9000 + 100 * pi as u64);
        let mut c = dsv4_model::synth::tiny_config(64);
        c.n_routed_experts = ne;
        c.n_experts_per_tok = 4;
        let bias_g = b.upload(HostTensor::new("bias", vec![ne], vec![0.0; ne])).unwrap();
        let bias_c = Tensor::new(1, ne, vec![0.0; ne]);
        // 150 rows (past the grouped kernels' 128): 600 pairs, ~75 an expert (tiles of 64
        // pairs); 200 rows: ~100 an expert (tiles of 128: on mma.sync, then on wgmma).
        for (n, wgmma) in [(150, false), (200, false), (200, true)] {
            b.set_pgemm_wgmma(wgmma);
            let (xg, xc) = activations(&b, n, d, 40 + n as u64);
            let (lg, lc) = activations(&b, n, ne, 50 + n as u64);
            let got = b.to_host(&b.moe(&xg, &b.route(&lg, Some(&bias_g), None, &c), &gpu_e, 0, 10.0));
            let want = experts_twin(&xc, &cpu.route(&lc, Some(&bias_c), None, &c), &cpu_e, 10.0);
            let e = rel_err(&got, &want);
            let (f1, f2) = (f13.name(), f2.name());
            println!("tiles {f1}/{f2} experts, {n} rows (wgmma {wgmma}): {e:.2e} from the bf16 twin");
            assert!(e <= 1e-3, "tiles {f1}/{f2} experts, {n} rows (wgmma {wgmma}): {e:.2e} from the bf16 twin");
        }
    }
    // The wgmma tiles' double-buffered stages at odd and tiny stage counts: Q8_0 experts with
    // d = 384 and 128 (gate/up: 6 and 2 stages) and inter = 320 and 64 (down: 5 and 1).
    b.set_pgemm_wgmma(true);
    for (d, inter) in [(384, 320), (128, 64)] {
        let f = PackedFormat::Q8_0;
        let (gpu_e, cpu_e) = random_experts(&b, (f, f), (d, inter, ne), 9900 + d as u64);
        let mut c = dsv4_model::synth::tiny_config(64);
        c.n_routed_experts = ne;
        c.n_experts_per_tok = 4;
        let bias_g = b.upload(HostTensor::new("bias", vec![ne], vec![0.0; ne])).unwrap();
        let bias_c = Tensor::new(1, ne, vec![0.0; ne]);
        let n = 200;
        let (xg, xc) = activations(&b, n, d, 60 + d as u64);
        let (lg, lc) = activations(&b, n, ne, 70 + d as u64);
        let got = b.to_host(&b.moe(&xg, &b.route(&lg, Some(&bias_g), None, &c), &gpu_e, 0, 10.0));
        let want = experts_twin(&xc, &cpu.route(&lc, Some(&bias_c), None, &c), &cpu_e, 10.0);
        let e = rel_err(&got, &want);
        println!("wgmma tiles, d {d}, inter {inter}: {e:.2e} from the bf16 twin");
        assert!(e <= 1e-3, "wgmma tiles, d {d}, inter {inter}: {e:.2e} from the bf16 twin");
    }
    b.set_pgemm_wgmma(false);
    b.set_tiles_dense_rows(dsv4_backend::cuda::gemm::TILES_DENSE_ROWS);
}

/// Routed experts as the tensor-core tiles compute them, in f64: x and the weights rounded to
/// bf16, h = SwiGLU(gate, up) rounded to bf16, the slots' outputs added in routing order.
fn experts_twin(x: &Tensor, r: &dsv4_backend::cpu::Route, experts: &[Expert<Tensor>], limit: f32) -> Vec<f32> {
    use dsv4_backend::bf16::round_bf16;
    let (d, inter) = (x.cols, experts[0].w1.rows);
    let dot = |w: &Tensor, o: usize, v: &[f64]| -> f64 {
        w.data[o * w.cols..(o + 1) * w.cols].iter().zip(v).map(|(a, b)| round_bf16(*a) as f64 * b).sum()
    };
    let mut out = vec![0f32; x.rows * d];
    for t in 0..x.rows {
        let xr: Vec<f64> = x.data[t * d..(t + 1) * d].iter().map(|&v| round_bf16(v) as f64).collect();
        for j in 0..r.k {
            let e = &experts[r.ids[t * r.k + j] as usize];
            let h: Vec<f64> = (0..inter)
                .map(|o| {
                    let g = (dot(&e.w1, o, &xr) as f32).min(limit);
                    let u = (dot(&e.w3, o, &xr) as f32).clamp(-limit, limit);
                    round_bf16(g / (1.0 + (-g).exp()) * u) as f64
                })
                .collect();
            for o in 0..d {
                out[t * d + o] += r.weights[t * r.k + j] * dot(&e.w2, o, &h) as f32;
            }
        }
    }
    out
}

/// The router's choice on the GPU against the CPU's: the same experts in the same order (score
/// plus bias descending, ties to the lower id) and weights within 1e-6, at V4's 256 experts and
/// at 300, with exact ties among the top scores: within a lane's experts (5 and 37) and across
/// lanes (3 and 200) of `route_row`'s warp.
/// `gemv_route` (the logits' product and the choice in one launch) chooses bitwise as `route`
/// does on its logits.
#[test]
fn cuda_router_choices_match_the_cpu() {
    let Some(b) = gpu() else { return };
    let cpu = CpuBackend;
    let (n, d, k) = (3, 512, 6);
    for e in [256, 300] {
        let mut c = dsv4_model::synth::tiny_config(64);
        c.n_routed_experts = e;
        c.n_experts_per_tok = k;
        let mut r = ChaCha8Rng::seed_from_u64(e as u64);
        let mut bias: Vec<f32> = (0..e).map(|_| r.gen_range(-0.05f32..0.05)).collect();
        let mut logits: Vec<f32> = (0..n * e).map(|_| r.gen_range(-2f32..2.0)).collect();
        for (c1, c2) in [(5, 37), (3, 200)] {
            bias[c2] = bias[c1];
            for row in 0..n {
                logits[row * e + c1] = 3.0 + row as f32;
                logits[row * e + c2] = 3.0 + row as f32;
            }
        }
        let bg = b.upload(HostTensor::new("bias", vec![e], bias.clone())).unwrap();
        let bc = Tensor::new(1, e, bias.clone());
        let lg = b.upload(HostTensor::new("logits", vec![n, e], logits.clone())).unwrap();
        let lg = CudaTensor::new(n, e, lg.data);
        let lc = Tensor::new(n, e, logits);
        let (rg, rc) = (b.route(&lg, Some(&bg), None, &c), cpu.route(&lc, Some(&bc), None, &c));
        let (ids, wts) = (b.download(&rg.ids), b.download(&rg.weights));
        assert_eq!(ids, rc.ids, "{e} experts: the GPU's choices against the CPU's");
        for (i, (g, w)) in wts.iter().zip(&rc.weights).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{e} experts: weight {i}: {g} against the CPU's {w}");
        }
        // The fused launch, on logits of its own product.
        let (xg, _) = activations(&b, n, d, 7 + e as u64);
        let gate: Vec<f32> = (0..e * d).map(|_| r.gen_range(-0.2f32..0.2)).collect();
        let gate = b.upload(HostTensor::new("gate", vec![e, d], gate)).unwrap();
        b.set_route_fused(true);
        let before = b.gemv_route_launches();
        let (lf, rf) = b.router(&xg, &gate, Some(&bg), None, &c);
        assert_eq!(b.gemv_route_launches(), before + 1, "{e} experts: the router did not take gemv_route");
        let ra = b.route(&lf, Some(&bg), None, &c);
        assert_eq!(b.download(&rf.ids), b.download(&ra.ids), "{e} experts: gemv_route's choices against route's");
        let (wf, wa) = (b.download(&rf.weights), b.download(&ra.weights));
        assert!(wf.iter().zip(&wa).all(|(x, y)| x.to_bits() == y.to_bits()), "{e} experts: gemv_route's weights");
        println!("{e} experts, {n} rows: the CPU's choices and weights; gemv_route bitwise route");
    }
}
