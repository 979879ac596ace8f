//! Products on int8-quantised activations: the CPU twin of the CUDA `x8` kernels
//! (`cuda/kernels/quant.cu`, `quant_x8` and `xdot32`), bit for bit.
//!
//! Why: a packed product at one row is bound by the instructions that decode the weights
//! (about 14 a weight for IQ2_XXS on f32 activations, PERF.md v3), not by their bytes. With the
//! activations quantised to int8 in blocks of 32 (scale `max|x| / 127`, as llama.cpp's q8_1),
//! four products cost one dp4a. The price is the activations' rounding: each value moves by at
//! most half a step, `max|x| / 254` of its block (the bound [`quantize`]'s test checks), which
//! is the size of a bf16 rounding for the block's largest values.
//!
//! The twin does what the kernel does, in its order: per lane `l` of a warp, the 32-value chunks
//! `c = 32l + 1024i` of the row; per chunk (per scale group) an exact integer sum and one fused
//! multiply-add of `weight scale · activation scale` into the lane's f32 accumulator; then the
//! warp's butterfly (`v += shfl_xor(v, o)` for o = 16, 8, 4, 2, 1), whose lane 0 holds the
//! result. Kernels over several rows decode each weight chunk once and apply it to every row
//! with the same integer sums and FMAs, so every row's result is this one-row result.

use dsv4_model::packed::PackedFormat;
use dsv4_model::quant::{IQ2XXS_GRID, KSIGNS_IQ2XS};

/// Values per activation scale.
pub const BLOCK: usize = 32;

/// The formats the int8 path serves (the GGUF q2 model's: IQ2_XXS and Q2_K experts, Q8_0 dense).
pub fn supports(f: PackedFormat) -> bool {
    matches!(f, PackedFormat::Q8_0 | PackedFormat::Q2_K | PackedFormat::IQ2_XXS)
}

/// A row's int8 activations and their block scales (`x.len()` a multiple of [`BLOCK`]):
/// `q = round(x / d)` with `d = max|x| / 127` (0 for an all-zero block). A block holding a NaN
/// or ±∞ gets `d = NaN` and zero codes, so its products are NaN rather than a silent number.
pub fn quantize(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    assert!(x.len().is_multiple_of(BLOCK), "int8 activations: width {} is not a multiple of {BLOCK}", x.len());
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; x.len() / BLOCK];
    for ((xb, qb), db) in x.chunks(BLOCK).zip(q.chunks_mut(BLOCK)).zip(&mut d) {
        if xb.iter().any(|v| !v.is_finite()) {
            *db = f32::NAN;
            continue;
        }
        let a = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = a / 127.0;
        let inv = if s != 0.0 { 1.0 / s } else { 0.0 };
        for (qi, &v) in qb.iter_mut().zip(xb) {
            *qi = ((v * inv).round() as i32).clamp(-127, 127) as i8;
        }
        *db = s;
    }
    (q, d)
}

fn f16(b: &[u8], i: usize) -> f32 {
    half_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// IEEE half to f32 (exact), as the kernels' `h2f`.
fn half_to_f32(h: u16) -> f32 {
    let s = ((h as u32) & 0x8000) << 16;
    let (e, m) = (((h >> 10) & 0x1f) as u32, (h & 0x3ff) as u32);
    match e {
        0 => {
            let v = m as f32 * 5.960_464_5e-8; // m · 2^-24, exact
            if s != 0 {
                -v
            } else {
                v
            }
        }
        31 => f32::from_bits(s | 0x7f80_0000 | (m << 13)),
        _ => f32::from_bits(s | ((e + 112) << 23) | (m << 13)),
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// `acc` plus weight values `c..c + 32` of `row` (`c` a multiple of 32) times the int8
/// activations `x` of scale `dx` (the kernel's `xdot32`).
pub fn xdot32(f: PackedFormat, row: &[u8], c: usize, x: &[i8], dx: f32, acc: f32) -> f32 {
    let x = &x[..BLOCK];
    let dot = |w: &dyn Fn(usize) -> i32, r: std::ops::Range<usize>| r.map(|j| w(j) * x[j] as i32).sum::<i32>();
    match f {
        PackedFormat::Q8_0 => {
            let blk = &row[(c / 32) * 34..];
            let is = dot(&|j| blk[2 + j] as i8 as i32, 0..32);
            (f16(blk, 0) * dx).mul_add(is as f32, acc)
        }
        PackedFormat::Q2_K => {
            let blk = &row[(c / 256) * 84..];
            let v = c % 256;
            let (h, sh) = (v >> 7, 2 * ((v >> 5) & 3));
            let (d, dm) = (f16(blk, 80), f16(blk, 82));
            let mut acc = acc;
            for g in 0..2 {
                let k = blk[(v >> 4) + g];
                let r = 16 * g..16 * g + 16;
                let is = dot(&|j| ((blk[16 + 32 * h + j] >> sh) & 3) as i32, r.clone());
                let xs: i32 = x[r].iter().map(|&b| b as i32).sum();
                let (dl, ml) = (d * (k & 15) as f32, dm * (k >> 4) as f32);
                acc = (dx * dl).mul_add(is as f32, acc);
                acc = (-(dx * ml)).mul_add(xs as f32, acc);
            }
            acc
        }
        PackedFormat::IQ2_XXS => {
            let blk = &row[(c / 256) * 66..];
            let p = 2 + 8 * ((c % 256) >> 5);
            let (a, sg) = (u32_at(blk, p), u32_at(blk, p + 4));
            let db = (f16(blk, 0) * (0.5 + (sg >> 28) as f32)) * 0.25;
            let w = |j: usize| {
                let kk = j / 8;
                let grid = IQ2XXS_GRID[((a >> (8 * kk)) & 255) as usize];
                let signs = KSIGNS_IQ2XS[((sg >> (7 * kk)) & 127) as usize];
                let g = ((grid >> (8 * (j % 8))) & 255) as i32;
                if (signs >> (j % 8)) & 1 == 1 {
                    -g
                } else {
                    g
                }
            };
            (db * dx).mul_add(dot(&w, 0..32) as f32, acc)
        }
        other => panic!("the int8 path does not serve {}", other.name()),
    }
}

/// One output: `row` (`k` values of format `f`) times the activations `(xq, xd)` of
/// [`quantize`], summed as the kernel's warp does.
pub fn dot(f: PackedFormat, row: &[u8], k: usize, xq: &[i8], xd: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (l, acc) in lanes.iter_mut().enumerate() {
        let mut c = BLOCK * l;
        while c < k {
            *acc = xdot32(f, row, c, &xq[c..c + BLOCK], xd[c / BLOCK], *acc);
            c += 32 * BLOCK;
        }
    }
    for o in [16, 8, 4, 2, 1] {
        let prev = lanes;
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = prev[l] + prev[l ^ o];
        }
    }
    lanes[0]
}

/// One output as the tensor-core tile kernels (`quant.cu`, `xtile`) form it: each chunk class
/// `l` (chunks `l, l + 32, ...`) summed alone, the classes visited in bit-reversed order and their
/// sums added in a plain binary tree over that order. Bitwise [`dot`]: the butterfly's tree pairs
/// lanes `l` and `l ^ 16` first, then `^ 8`, ..., which is the binary tree over bit-reversed `l`
/// (the property the tile kernels' batch invariance rests on; tested below).
pub fn dot_tiled(f: PackedFormat, row: &[u8], k: usize, xq: &[i8], xd: &[f32]) -> f32 {
    let mut sums = [0f32; 32];
    for (t, s) in sums.iter_mut().enumerate() {
        let l = (t as u32).reverse_bits() as usize >> 27;
        let mut c = BLOCK * l;
        while c < k {
            *s = xdot32(f, row, c, &xq[c..c + BLOCK], xd[c / BLOCK], *s);
            c += 32 * BLOCK;
        }
    }
    let mut st = 1;
    while st < 32 {
        for q in (0..32).step_by(2 * st) {
            sums[q] += sums[q + st];
        }
        st *= 2;
    }
    sums[0]
}

/// The IQ2_XXS table the kernels decode with, as a C declaration with `qualifier` (the CUDA
/// kernels' and the host build's): each grid entry's byte-permute selectors (`IQ2XXS_SEL`,
/// quant.cu `iq2_quad`), a nibble a value, the level of its magnitude (8, 25, 43 → 0, 1, 2); the
/// low word the entry's first quad, the high word its second. (The grid itself and GGUF's sign
/// patterns are not declared: the planes hold every sign, so a `quant.cu` of the old sign order
/// fails to compile here rather than decode wrongly.)
pub fn iq2_tables_source(qualifier: &str) -> String {
    let sel: Vec<String> = IQ2XXS_GRID
        .iter()
        .map(|&g| {
            let nib = |j: usize| -> u64 {
                match (g >> (8 * j)) & 255 {
                    0x08 => 0,
                    0x19 => 1,
                    0x2b => 2,
                    b => panic!("IQ2_XXS grid byte {b:#x} is not 8, 25 or 43"),
                }
            };
            let quad = |h: usize| (0..4).fold(0u64, |w, i| w | nib(4 * h + i) << (4 * i));
            format!("0x{:016x}ull", quad(0) | quad(1) << 32)
        })
        .collect();
    format!("{qualifier} unsigned long long IQ2XXS_SEL[256] = {{{}}};\n", sel.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_model::quant::{dequant_iq2_xxs, dequant_q2_k, dequant_q8_0};

    fn lcg(s: &mut u64) -> u64 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *s >> 33
    }

    /// A row of `k` values of format `f` in random blocks with finite, moderate f16 scales.
    fn random_row(f: PackedFormat, k: usize, s: &mut u64) -> Vec<u8> {
        let mut row: Vec<u8> = (0..f.row_bytes(k)).map(|_| lcg(s) as u8).collect();
        let (bb, offs): (usize, &[usize]) = match f {
            PackedFormat::Q8_0 => (34, &[0]),
            PackedFormat::Q2_K => (84, &[80, 82]),
            _ => (66, &[0]),
        };
        for b in row.chunks_mut(bb) {
            for &o in offs {
                let h = 0x2000u16 | (lcg(s) as u16 & 0x0fff);
                b[o..o + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        row
    }

    #[test]
    fn quantised_activations_are_within_half_a_step() {
        let mut s = 1u64;
        let x: Vec<f32> = (0..4096).map(|_| (lcg(&mut s) as f32 / (1u64 << 31) as f32 - 0.5) * 7.0).collect();
        let (q, d) = quantize(&x);
        for (i, (&v, &qi)) in x.iter().zip(&q).enumerate() {
            let step = d[i / BLOCK];
            assert!((qi as f32 * step - v).abs() <= 0.5 * step * (1.0 + 1e-6), "value {i}: {v} vs {qi}·{step}");
        }
        let mut z = vec![0f32; 64];
        z[40] = f32::NAN;
        let (q, d) = quantize(&z);
        assert_eq!(d[0], 0.0);
        assert!(d[1].is_nan() && q[32..].iter().all(|&c| c == 0));
    }

    /// The tile kernels' order (class sums in a binary tree over bit-reversed classes) gives
    /// bitwise the one-row kernels' result, for widths whose classes hold 0, 1 or several chunks.
    #[test]
    fn tiled_order_is_the_butterfly() {
        let mut s = 11u64;
        for k in [256, 512, 1536, 4096] {
            let x: Vec<f32> = (0..k).map(|_| (lcg(&mut s) as f32 / (1u64 << 31) as f32 - 0.5) * 5.0).collect();
            let (xq, xd) = quantize(&x);
            for f in [PackedFormat::Q8_0, PackedFormat::Q2_K, PackedFormat::IQ2_XXS] {
                for _ in 0..4 {
                    let row = random_row(f, k, &mut s);
                    let (a, b) = (dot(f, &row, k, &xq, &xd), dot_tiled(f, &row, k, &xq, &xd));
                    assert_eq!(a.to_bits(), b.to_bits(), "{} k {k}: butterfly {a} vs tiled {b}", f.name());
                }
            }
        }
    }

    /// The twin's products against the exact f32 products of the dequantised weights: off by
    /// the activations' rounding only (the test's bound: Σ|w|·d/2 over the row, plus f32 noise).
    #[test]
    fn int8_products_are_the_exact_ones_within_the_rounding_bound() {
        let k = 2048;
        let mut s = 7u64;
        let x: Vec<f32> = (0..k).map(|_| (lcg(&mut s) as f32 / (1u64 << 31) as f32 - 0.5) * 3.0).collect();
        let (xq, xd) = quantize(&x);
        for f in [PackedFormat::Q8_0, PackedFormat::Q2_K, PackedFormat::IQ2_XXS] {
            for r in 0..8 {
                let row = random_row(f, k, &mut s);
                let mut w = vec![0f32; k];
                match f {
                    PackedFormat::Q8_0 => dequant_q8_0(&row, &mut w),
                    PackedFormat::Q2_K => dequant_q2_k(&row, &mut w),
                    _ => dequant_iq2_xxs(&row, &mut w),
                }
                let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let bound: f64 =
                    w.iter().enumerate().map(|(i, &a)| (a as f64).abs() * xd[i / BLOCK] as f64 * 0.5).sum();
                let got = dot(f, &row, k, &xq, &xd) as f64;
                let scale: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                assert!(
                    (got - exact).abs() <= bound + 1e-5 * scale,
                    "{} row {r}: int8 {got} vs exact {exact} (bound {bound})",
                    f.name()
                );
            }
        }
    }
}
