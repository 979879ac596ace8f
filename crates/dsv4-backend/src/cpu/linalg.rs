//! Dense f32 kernels of the CPU backend.
//!
//! Every output element `out[i][j] = x_i · w_j` is one dot product with a fixed summation order
//! (8 strided lanes, then a fixed tree), whatever the tile it lands in or the number of rows in
//! the batch. That makes the CPU oracle batch-invariant bitwise: a sequence's logits do not
//! depend on which other rows share its batch.

use rayon::prelude::*;

const LANES: usize = 8;

#[inline(always)]
fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// The reference dot product; every other kernel here reproduces its order exactly.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
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

/// Four dot products of one `x` row against four `w` rows, each in [`dot`]'s exact order.
#[inline]
fn dot4(x: &[f32], w0: &[f32], w1: &[f32], w2: &[f32], w3: &[f32]) -> [f32; 4] {
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
        // Each row alone gives bitwise the same values as inside the batch.
        for i in 0..n {
            let one = matmul_t(&x[i * k..(i + 1) * k], 1, k, &w, m);
            assert_eq!(one, got[i * m..(i + 1) * m].to_vec(), "row {i}");
            assert_eq!(one[5], dot(&x[i * k..(i + 1) * k], &w[5 * k..6 * k]));
        }
    }
}
