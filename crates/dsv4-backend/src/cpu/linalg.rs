//! Dense f32 kernels of the CPU backend.
//!
//! Every output element `out[i][j] = x_i · w_j` is one dot product with a fixed summation order
//! (8 strided lanes, then a fixed tree), whatever the tile it lands in or the number of rows in
//! the batch. That makes the CPU oracle batch-invariant bitwise: a sequence's logits do not
//! depend on which other rows share its batch.
//!
//! On x86-64 with AVX2 and FMA every dot product (single or tiled) runs the fused-multiply-add
//! kernels of [`simd`], chosen once per process, so all of them still share one summation order.

use rayon::prelude::*;

const LANES: usize = 8;

#[inline(always)]
fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Whether the AVX2+FMA kernels are used (decided once per process).
fn use_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static FMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FMA.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The dot product every kernel here uses: lane `l` of 8 accumulates elements `l, l+8, …` in
/// order, then a fixed tree adds the lanes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if use_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked by `use_fma`); slices have equal length.
        return unsafe { simd::dot(a, b) };
    }
    dot_scalar(a, b)
}

#[inline]
fn dot4(x: &[f32], w0: &[f32], w1: &[f32], w2: &[f32], w3: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if use_fma() {
        // SAFETY: as in `dot`; every `w` row has the length of `x`.
        return unsafe { simd::dot4(x, w0, w1, w2, w3) };
    }
    dot4_scalar(x, w0, w1, w2, w3)
}

/// AVX2 + FMA versions of the dot kernels, in the same lane order as the portable ones.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{reduce, LANES};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2 and FMA, and `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let k = a.len();
        let full = k / LANES * LANES;
        let mut acc = _mm256_setzero_ps();
        let mut o = 0;
        while o < full {
            // SAFETY: o + 8 <= full <= len of both slices.
            acc =
                unsafe { _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(o)), _mm256_loadu_ps(b.as_ptr().add(o)), acc) };
            o += LANES;
        }
        let mut lanes = [0f32; LANES];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        for l in 0..k - full {
            lanes[l] = a[full + l].mul_add(b[full + l], lanes[l]);
        }
        reduce(lanes)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA, and every slice must have `x.len()` elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(x: &[f32], w0: &[f32], w1: &[f32], w2: &[f32], w3: &[f32]) -> [f32; 4] {
        let k = x.len();
        let full = k / LANES * LANES;
        let (mut a0, mut a1, mut a2, mut a3) =
            (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut o = 0;
        while o < full {
            // SAFETY: o + 8 <= full <= the length of every slice.
            unsafe {
                let xv = _mm256_loadu_ps(x.as_ptr().add(o));
                a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0.as_ptr().add(o)), a0);
                a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1.as_ptr().add(o)), a1);
                a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2.as_ptr().add(o)), a2);
                a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3.as_ptr().add(o)), a3);
            }
            o += LANES;
        }
        let mut out = [0f32; 4];
        for (j, (acc, w)) in [(a0, w0), (a1, w1), (a2, w2), (a3, w3)].into_iter().enumerate() {
            let mut lanes = [0f32; LANES];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            for l in 0..k - full {
                lanes[l] = x[full + l].mul_add(w[full + l], lanes[l]);
            }
            out[j] = reduce(lanes);
        }
        out
    }
}

/// The portable dot product (no FMA): the same lane order as [`simd::dot`].
#[inline]
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let k = a.len();
    let mut acc = [0f32; LANES];
    let full = k / LANES * LANES;
    for (ca, cb) in a[..full].chunks_exact(LANES).zip(b[..full].chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += ca[l] * cb[l];
        }
    }
    for l in 0..k - full {
        acc[l] += a[full + l] * b[full + l];
    }
    reduce(acc)
}

/// Four dot products of one `x` row against four `w` rows, each in [`dot_scalar`]'s exact order.
#[inline]
fn dot4_scalar(x: &[f32], w0: &[f32], w1: &[f32], w2: &[f32], w3: &[f32]) -> [f32; 4] {
    let k = x.len();
    let full = k / LANES * LANES;
    let mut a0 = [0f32; LANES];
    let mut a1 = [0f32; LANES];
    let mut a2 = [0f32; LANES];
    let mut a3 = [0f32; LANES];
    let mut o = 0;
    while o < full {
        let xs = &x[o..o + LANES];
        let (b0, b1, b2, b3) = (&w0[o..o + LANES], &w1[o..o + LANES], &w2[o..o + LANES], &w3[o..o + LANES]);
        for l in 0..LANES {
            a0[l] += xs[l] * b0[l];
            a1[l] += xs[l] * b1[l];
            a2[l] += xs[l] * b2[l];
            a3[l] += xs[l] * b3[l];
        }
        o += LANES;
    }
    for l in 0..k - full {
        let xv = x[full + l];
        a0[l] += xv * w0[full + l];
        a1[l] += xv * w1[full + l];
        a2[l] += xv * w2[full + l];
        a3[l] += xv * w3[full + l];
    }
    [reduce(a0), reduce(a1), reduce(a2), reduce(a3)]
}

/// `out[n, m] = x[n, k] · w[m, k]ᵀ` (weights stored `[out, in]` as in the checkpoints).
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
    assert_eq!(x.len(), n * k, "matmul: x is not [{n}, {k}]");
    assert_eq!(w.len(), m * k, "matmul: w is not [{m}, {k}]");
    const RB: usize = 8;
    // Column blocks sized so a block of W (~256 KiB) stays in L2 while RB rows pass over it.
    let cb = ((256 * 1024 / 4) / k.max(1)).clamp(4, 256) / 4 * 4;
    let row_blocks = n.div_ceil(RB);
    let col_blocks = m.div_ceil(cb);
    let tiles: Vec<(usize, usize, Vec<f32>)> = (0..row_blocks * col_blocks)
        .into_par_iter()
        .map(|t| {
            let (rb, c) = (t % row_blocks, t / row_blocks);
            let (r0, r1) = (rb * RB, ((rb + 1) * RB).min(n));
            let (c0, c1) = (c * cb, ((c + 1) * cb).min(m));
            let w_ = |j: usize| &w[j * k..(j + 1) * k];
            let mut buf = vec![0f32; (r1 - r0) * (c1 - c0)];
            for i in r0..r1 {
                let xi = &x[i * k..(i + 1) * k];
                let row = &mut buf[(i - r0) * (c1 - c0)..(i - r0 + 1) * (c1 - c0)];
                let mut j = c0;
                while j + 4 <= c1 {
                    let r = dot4(xi, w_(j), w_(j + 1), w_(j + 2), w_(j + 3));
                    row[j - c0..j - c0 + 4].copy_from_slice(&r);
                    j += 4;
                }
                while j < c1 {
                    row[j - c0] = dot(xi, w_(j));
                    j += 1;
                }
            }
            (t, c1 - c0, buf)
        })
        .collect();
    let mut out = vec![0f32; n * m];
    for (t, width, buf) in tiles {
        let (rb, c) = (t % row_blocks, t / row_blocks);
        let (r0, c0) = (rb * RB, c * cb);
        for (ri, chunk) in buf.chunks_exact(width).enumerate() {
            out[(r0 + ri) * m + c0..(r0 + ri) * m + c0 + width].copy_from_slice(chunk);
        }
    }
    out
}

/// Root-mean-square normalisation of each `group`-wide slice of every row, optionally weighted.
pub fn rms_norm(x: &[f32], group: usize, w: Option<&[f32]>, eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    out.par_chunks_mut(group).for_each(|g| {
        let ms = g.iter().map(|v| v * v).sum::<f32>() / group as f32;
        let r = 1.0 / (ms + eps).sqrt();
        match w {
            Some(w) => g.iter_mut().zip(w).for_each(|(v, wi)| *v = *v * r * wi),
            None => g.iter_mut().for_each(|v| *v *= r),
        }
    });
    out
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f64> {
        let mut o = vec![0f64; n * m];
        for i in 0..n {
            for j in 0..m {
                o[i * m + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
            }
        }
        o
    }

    #[test]
    fn matmul_matches_naive_and_is_row_independent() {
        let (n, k, m) = (19, 37, 23);
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        let w: Vec<f32> = (0..m * k).map(|i| ((i * 104729 % 1000) as f32 / 500.0) - 1.0).collect();
        let got = matmul_t(&x, n, k, &w, m);
        let want = naive(&x, n, k, &w, m);
        for (g, e) in got.iter().zip(&want) {
            assert!((*g as f64 - e).abs() < 1e-4, "{g} vs {e}");
        }
        // Each row alone gives bitwise the same values as inside the batch (and as `dot`).
        for i in 0..n {
            let one = matmul_t(&x[i * k..(i + 1) * k], 1, k, &w, m);
            assert_eq!(one, got[i * m..(i + 1) * m].to_vec(), "row {i}");
            assert_eq!(one[5], dot(&x[i * k..(i + 1) * k], &w[5 * k..6 * k]));
        }
    }
}
