//! The DSpark drafter's own ops on the CPU (spec `dspark.md` §3.5–§3.6): the non-causal block
//! attention over an explicit key set, ring row writes and the greedy Markov choice. Each has a
//! CUDA twin in `cuda/kernels/dspark.cu`.

use super::linalg::dot;
use super::Tensor;

/// Sink-softmax attention in which every query row sees every key (the non-causal block):
/// `q [rows, heads·hd]`, `keys` each `hd` wide (K = V), `sinks [heads]` enter the denominator
/// only; scale `hd^-½`. Returns `[rows, heads·hd]`.
pub fn block_attention(q: &[f32], heads: usize, hd: usize, keys: &[&[f32]], sinks: &[f32]) -> Vec<f32> {
    let rows = q.len() / (heads * hd);
    let scale = (hd as f32).powf(-0.5);
    let mut out = vec![0f32; rows * heads * hd];
    let mut sc = vec![0f32; keys.len()];
    for t in 0..rows {
        for h in 0..heads {
            let qh = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            for (s, k) in sc.iter_mut().zip(keys) {
                *s = dot(qh, k) * scale;
            }
            let m = sc.iter().copied().fold(sinks[h], f32::max);
            let mut den = (sinks[h] - m).exp();
            for s in sc.iter_mut() {
                *s = (*s - m).exp();
                den += *s;
            }
            let oh = &mut out[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            for (s, k) in sc.iter().zip(keys) {
                let p = s / den;
                for (a, b) in oh.iter_mut().zip(k.iter()) {
                    *a += p * b;
                }
            }
        }
    }
    out
}

/// The first index of the maximum (torch's argmax).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// [`crate::Backend::block_attention`]: query rows in groups of `q.rows / rings.len()`; group `g`
/// attends to rows `slots[g]` of `rings[g]` (in that order), then to its own rows of `kb`.
pub fn grouped_block_attention(
    q: &Tensor,
    kb: &Tensor,
    rings: &[&Tensor],
    slots: &[Vec<usize>],
    sinks: &Tensor,
    heads: usize,
) -> Tensor {
    let hd = kb.cols;
    let groups = rings.len();
    assert_eq!(slots.len(), groups, "one slot list per ring");
    assert!(groups > 0 && q.rows.is_multiple_of(groups) && kb.rows == q.rows, "block rows per group");
    let qpg = q.rows / groups;
    let w = heads * hd;
    let mut out = Vec::with_capacity(q.rows * w);
    for (g, (ring, sl)) in rings.iter().zip(slots).enumerate() {
        let mut keys: Vec<&[f32]> = sl.iter().map(|&s| ring.row(s)).collect();
        keys.extend((g * qpg..(g + 1) * qpg).map(|k| kb.row(k)));
        out.extend(block_attention(&q.data[g * qpg * w..(g + 1) * qpg * w], heads, hd, &keys, &sinks.data));
    }
    Tensor::new(q.rows, w, out)
}
