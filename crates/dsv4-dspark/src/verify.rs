//! Acceptance of a verified block (spec §6).

use rand::Rng;

use crate::drafter::{argmax, sample};

/// Greedy acceptance: `target_logits` are the `ℓ+1` verify rows `[ℓ+1, vocab]` of
/// `[anchor, d_0..d_{ℓ-1}]` (row `i` predicts the token after input `i`). Returns the number of
/// accepted drafts `n ≤ ℓ` and the bonus/correction token `argmax(row n)`.
pub fn accept_greedy(drafts: &[u32], target_logits: &[f32], vocab: usize) -> (usize, u32) {
    let ids: Vec<u32> = target_logits.chunks(vocab).map(|r| argmax(r) as u32).collect();
    accept_greedy_ids(drafts, &ids)
}

/// [`accept_greedy`] from the verify rows' argmax alone (`target_ids [ℓ+1]`, the first index of
/// each row's maximum): what a step that brings back only token ids gives.
pub fn accept_greedy_ids(drafts: &[u32], target_ids: &[u32]) -> (usize, u32) {
    let l = target_ids.len() - 1;
    assert!(drafts.len() >= l, "{} drafts for {} verified slots", drafts.len(), l);
    let mut n = 0;
    while n < l && drafts[n] == target_ids[n] {
        n += 1;
    }
    (n, target_ids[n])
}

/// Token-level rejection sampling (Leviathan/Chen). `target_probs [ℓ+1, vocab]` are the target
/// distributions of the verify rows (after temperature and any filtering), `draft_probs` the
/// exact distributions the drafts were drawn from (`None`: greedy drafting, point masses).
/// Returns `(n accepted, next token)`; the output is distributed as the target's.
pub fn accept_sampled<R: Rng + ?Sized>(
    drafts: &[u32],
    draft_probs: Option<&[f32]>,
    target_probs: &[f32],
    vocab: usize,
    rng: &mut R,
) -> (usize, u32) {
    let l = target_probs.len() / vocab - 1;
    for (k, &d) in drafts.iter().enumerate().take(l) {
        let pt = &target_probs[k * vocab..(k + 1) * vocab];
        let pd: Vec<f32> = match draft_probs {
            Some(q) => q[k * vocab..(k + 1) * vocab].to_vec(),
            None => (0..vocab).map(|i| if i == d as usize { 1.0 } else { 0.0 }).collect(),
        };
        let (a, b) = (pt[d as usize] as f64, pd[d as usize] as f64);
        let u: f64 = rng.gen();
        if b > 0.0 && u < (a / b).min(1.0) {
            continue;
        }
        let resid: Vec<f32> = pt.iter().zip(&pd).map(|(x, y)| (x - y).max(0.0)).collect();
        let mass: f64 = resid.iter().map(|&x| x as f64).sum();
        let y = if mass > 1e-12 { sample(&resid, rng) } else { sample(pt, rng) };
        return (k, y as u32);
    }
    (l, sample(&target_probs[l * vocab..(l + 1) * vocab], rng) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn greedy_accepts_the_matching_prefix() {
        let v = 3;
        // rows predict 2, 0, 1
        let logits = [0.0, 0.1, 0.9, 0.8, 0.1, 0.0, 0.0, 0.7, 0.1];
        assert_eq!(accept_greedy(&[2, 0], &logits, v), (2, 1));
        assert_eq!(accept_greedy(&[2, 1], &logits, v), (1, 0));
        assert_eq!(accept_greedy(&[0, 0], &logits, v), (0, 2));
        assert_eq!(accept_greedy(&[0, 0], &logits[..3], v), (0, 2));
        // From the rows' argmax alone (a step that brings back only ids): the same verdicts.
        assert_eq!(accept_greedy_ids(&[2, 0], &[2, 0, 1]), (2, 1));
        assert_eq!(accept_greedy_ids(&[2, 1], &[2, 0, 1]), (1, 0));
        assert_eq!(accept_greedy_ids(&[0, 0], &[2, 0, 1]), (0, 2));
        assert_eq!(accept_greedy_ids(&[0, 0], &[2]), (0, 2));
    }

    /// The first emitted token of a round is distributed as the target's first row, whatever the
    /// proposal (random, disjoint support, point mass).
    #[test]
    fn rejection_sampling_preserves_the_target_distribution() {
        let v = 4;
        let pt = [0.1f32, 0.2, 0.3, 0.4, 0.25, 0.25, 0.25, 0.25];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for pd in [[0.7f32, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 1.0], [0.4, 0.3, 0.2, 0.1]] {
            for greedy in [false, true] {
                let n = 200_000;
                let mut hist = [0usize; 4];
                for _ in 0..n {
                    let (d, q) = if greedy { (2u32, None) } else { (sample(&pd, &mut rng) as u32, Some(&pd[..])) };
                    let (acc, y) = accept_sampled(&[d], q, &pt, v, &mut rng);
                    hist[if acc == 1 { d } else { y } as usize] += 1;
                }
                let tv: f64 = (0..v).map(|i| (hist[i] as f64 / n as f64 - pt[i] as f64).abs()).sum::<f64>() / 2.0;
                assert!(tv < 6e-3, "pd {pd:?} greedy {greedy}: TV {tv}, hist {hist:?}");
            }
        }
    }
}
