//! Token sampling: greedy, temperature, top-k, top-p and min-p, reproducible from a seed.

use dsv4_backend::Draw;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p · p_max`; 0 disables.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, seed: 0 }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SampleError {
    #[error("logits contain a non-finite value at token {index}: refusing to sample")]
    NonFinite { index: usize },
    #[error("invalid sampling parameter: {0}")]
    Param(String),
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SampleError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SampleError::Param(format!("temperature {} must be >= 0", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SampleError::Param(format!("top_p {} must be in (0, 1]", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SampleError::Param(format!("min_p {} must be in [0, 1]", self.min_p)));
        }
        Ok(())
    }
}

/// The best token (lowest id on ties) and its margin over the runner-up.
pub fn argmax_margin(logits: &[f32]) -> (u32, f32) {
    let mut best = (0usize, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0 as u32, best.1 - second)
}

/// The `k` best candidates (by value, then id), sorted: a partial selection, then a sort of
/// those `k`.
fn best(mut cand: Vec<(u32, f32)>, k: usize) -> Vec<(u32, f32)> {
    let by_value = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = k.clamp(1, cand.len());
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_value);
        cand.truncate(k);
    }
    cand.sort_by(by_value);
    cand
}

pub struct Sampler {
    pub params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, SampleError> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng })
    }

    pub fn greedy() -> Self {
        Self::new(SamplingParams::default()).expect("default params are valid")
    }

    /// The generator the sampler draws from (speculative acceptance draws from it too, so a
    /// sequence's randomness stays one reproducible stream).
    pub fn rng_mut(&mut self) -> &mut ChaCha8Rng {
        &mut self.rng
    }

    /// The next token's draw on the device ([`dsv4_backend::draw`]): the parameters and the
    /// one uniform [`Sampler::sample`] would take from the generator (none when greedy). On
    /// the same logits its token is `sample`'s unless that uniform falls within ~2e-6 of a
    /// boundary of the distribution (the device's weights are f32, then multiples of 2⁻⁴⁶).
    pub fn device_draw(&mut self) -> Draw {
        if self.params.temperature == 0.0 {
            return Draw::GREEDY;
        }
        let u = self.rng.gen::<f64>();
        self.draw_with(u)
    }

    /// The uniform of the token at absolute sequence position `pos` (prompt positions count):
    /// a pure function of the seed and the position, the `pos`-th 64-bit word pair of the
    /// seed's ChaCha8 stream. Whatever computes the token at `pos` (a plain decode row, a
    /// speculative verify row, the host or the device) draws it with this uniform, so a
    /// sequence's tokens do not depend on how its rows were batched or verified.
    pub fn uniform_at(&self, pos: usize) -> f64 {
        let mut rng = ChaCha8Rng::seed_from_u64(self.params.seed);
        rng.set_word_pos(2 * pos as u128);
        rng.gen::<f64>()
    }

    /// The device draw of the token at position `pos` ([`Sampler::uniform_at`]); greedy at
    /// temperature 0. On the same logits its token is [`Sampler::sample_at`]'s (up to the
    /// ~2e-6 boundary of [`Sampler::device_draw`]).
    pub fn device_draw_at(&self, pos: usize) -> Draw {
        if self.params.temperature == 0.0 {
            return Draw::GREEDY;
        }
        self.draw_with(self.uniform_at(pos))
    }

    fn draw_with(&self, u: f64) -> Draw {
        let p = &self.params;
        let top_k = u32::try_from(p.top_k).unwrap_or(u32::MAX);
        Draw { temperature: p.temperature, top_k, top_p: p.top_p, min_p: p.min_p, u }
    }

    /// The full-vocabulary distribution [`Sampler::sample`] draws from at temperature > 0
    /// (temperature, top-k, top-p and min-p applied; filtered tokens get 0). At temperature 0, a
    /// point mass on the argmax.
    pub fn probs(&self, logits: &[f32]) -> Result<Vec<f32>, SampleError> {
        if let Some(index) = logits.iter().position(|v| !v.is_finite()) {
            return Err(SampleError::NonFinite { index });
        }
        let mut out = vec![0f32; logits.len()];
        let p = &self.params;
        if p.temperature == 0.0 {
            out[argmax_margin(logits).0 as usize] = 1.0;
            return Ok(out);
        }
        let (cand, probs, keep) = self.filtered(logits);
        let mass: f64 = probs[..keep].iter().sum();
        for (c, q) in cand[..keep].iter().zip(&probs) {
            out[c.0 as usize] = (q / mass) as f32;
        }
        Ok(out)
    }

    /// The candidates in the order a draw walks them, their probabilities and how many survive
    /// the filters. The probabilities are normalised over the candidates the filters start
    /// from: the `top_k` best when set, else the whole vocabulary. Only what the filters need is
    /// sorted (by logit, then id): the `top_k` best after a partial selection; for top-p and
    /// min-p without top-k, a sorted prefix grown until the cut falls inside it; with no filter,
    /// nothing (the vocabulary in id order). A full sort per token cost ~7 ms at V4's 129K
    /// vocabulary; this costs well under one.
    fn filtered(&self, logits: &[f32]) -> (Vec<(u32, f32)>, Vec<f64>, usize) {
        let p = &self.params;
        let t = p.temperature as f64;
        let all = || logits.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect::<Vec<_>>();
        if p.top_k > 0 {
            let cand = best(all(), p.top_k);
            // Scaled after subtracting the maximum, in f64: a tiny temperature then gives -inf
            // (probability 0), never inf - inf = NaN.
            let m = cand[0].1 as f64;
            let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 as f64 - m) / t).exp()).collect();
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= total);
            let keep = self.cut(&probs, probs.len()).0;
            return (cand, probs, keep);
        }
        let m = logits.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
        let w: Vec<f64> = logits.iter().map(|&v| ((v as f64 - m) / t).exp()).collect();
        let total: f64 = w.iter().sum();
        if p.top_p >= 1.0 && p.min_p <= 0.0 {
            let probs: Vec<f64> = w.iter().map(|x| x / total).collect();
            let n = probs.len();
            return (all(), probs, n);
        }
        // min-p keeps at most the tokens at or above its floor (the best token's probability,
        // 1/total, times min_p): counted directly, so the prefix never grows past them.
        let cap = if p.min_p > 0.0 {
            let floor = (1.0 / total) * p.min_p as f64;
            w.iter().filter(|&&x| x / total >= floor).count().max(1)
        } else {
            logits.len()
        };
        let mut k = 256.min(cap);
        loop {
            let cand = best(all(), k);
            let probs: Vec<f64> = cand.iter().map(|c| w[c.0 as usize] / total).collect();
            let (keep, inside) = self.cut(&probs, logits.len());
            if inside || k == cap {
                return (cand, probs, keep);
            }
            k = (k * 8).min(cap);
        }
    }

    /// How many of the best-first `probs` (a prefix of `n` candidates) top-p and min-p keep, and
    /// whether the cut is known from the prefix alone (it fell inside it).
    fn cut(&self, probs: &[f64], n: usize) -> (usize, bool) {
        let p = &self.params;
        let mut keep = probs.len();
        let mut inside = probs.len() == n;
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    inside = true;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            let above = probs.iter().take_while(|&&q| q >= floor).count();
            inside |= above < probs.len();
            keep = keep.min(above.max(1));
        }
        (keep, inside)
    }

    /// Picks the next token with the next uniform of the sampler's sequential stream (rows with
    /// a host pass; [`Sampler::sample_at`] keys the uniform by position instead). Non-finite
    /// logits are an error, never a silent token.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        // The generator moves out for the draw (`pick` borrows the parameters): a copy of ~200
        // bytes, nothing next to the draw.
        let mut rng = self.rng.clone();
        let r = self.pick(logits, || rng.gen::<f64>());
        self.rng = rng;
        r
    }

    /// Picks the token at absolute position `pos` with [`Sampler::uniform_at`]`(pos)`: the
    /// host twin of [`Sampler::device_draw_at`]. Leaves the sequential stream alone.
    pub fn sample_at(&self, logits: &[f32], pos: usize) -> Result<u32, SampleError> {
        self.pick(logits, || self.uniform_at(pos))
    }

    /// The draw of [`Sampler::sample`] with the uniform `u()` (taken only when sampling).
    fn pick(&self, logits: &[f32], u: impl FnOnce() -> f64) -> Result<u32, SampleError> {
        let p = &self.params;
        if let Some(index) = logits.iter().position(|v| !v.is_finite()) {
            return Err(SampleError::NonFinite { index });
        }
        if p.temperature == 0.0 {
            return Ok(argmax_margin(logits).0);
        }
        if p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0 {
            // No filter: one pass of weights in id order, the draw walks them unnormalised.
            let (m, t) = (logits.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64, p.temperature as f64);
            let w: Vec<f64> = logits.iter().map(|&v| ((v as f64 - m) / t).exp()).collect();
            let total: f64 = w.iter().sum();
            let mut r = u() * total;
            for (i, q) in w.iter().enumerate() {
                r -= q;
                if r <= 0.0 {
                    return Ok(i as u32);
                }
            }
            return Ok(w.iter().rposition(|&q| q > 0.0).unwrap_or(0) as u32);
        }
        let (cand, probs, keep) = self.filtered(logits);
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = u() * mass;
        for (i, q) in probs[..keep].iter().enumerate() {
            r -= q;
            if r <= 0.0 {
                return Ok(cand[i].0);
            }
        }
        Ok(cand[keep - 1].0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_backend::draw::CHECKED_MIXES;

    #[test]
    fn greedy_takes_lowest_id_on_ties_and_rejects_nan() {
        let mut s = Sampler::greedy();
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 0.0]).unwrap(), 1);
        assert_eq!(s.sample(&[1.0, f32::NAN]), Err(SampleError::NonFinite { index: 1 }));
        assert_eq!(argmax_margin(&[1.0, 3.0, 2.5]), (1, 0.5));
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams { temperature: 0.8, top_k: 5, seed: 42, ..Default::default() };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone()).unwrap();
            (0..200).map(|_| s.sample(&logits).unwrap()).collect()
        };
        let mut s = Sampler::new(params).unwrap();
        let b: Vec<u32> = (0..200).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(a, b);
        let mut top5: Vec<u32> = (0..50).collect();
        top5.sort_by(|x, y| logits[*y as usize].total_cmp(&logits[*x as usize]));
        assert!(a.iter().all(|t| top5[..5].contains(t)));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
    }

    #[test]
    fn tiny_temperatures_pick_the_argmax_not_nan() {
        let logits = [0.5f32, 3.0, -2.0, 2.9999, 1.0];
        for t in [1e-40f32, f32::MIN_POSITIVE, 1e-45, 1e-20] {
            let mut s = Sampler::new(SamplingParams { temperature: t, seed: 7, ..Default::default() }).unwrap();
            for _ in 0..20 {
                assert_eq!(s.sample(&logits).unwrap(), 1, "temperature {t}");
            }
            let p = s.probs(&logits).unwrap();
            assert!(p.iter().all(|x| x.is_finite()), "temperature {t}: {p:?}");
            assert_eq!(p[1], 1.0, "temperature {t}: {p:?}");
        }
        // Ties at a tiny temperature share the mass, in id order.
        let s = Sampler::new(SamplingParams { temperature: 1e-40, ..Default::default() }).unwrap();
        assert_eq!(s.probs(&[1.0, 4.0, 4.0]).unwrap(), vec![0.0, 0.5, 0.5]);
    }

    /// The filters as first written: every candidate sorted, probabilities over all of them.
    fn reference_probs(p: &SamplingParams, logits: &[f32]) -> Vec<f64> {
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let (m, t) = (cand[0].1 as f64, p.temperature as f64);
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 as f64 - m) / t).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut out = vec![0f64; logits.len()];
        for (c, q) in cand[..keep].iter().zip(&probs) {
            out[c.0 as usize] = q / mass;
        }
        out
    }

    /// The partial-sort filters give the distribution of the full sort (to f64 rounding), for
    /// top-k, top-p, min-p, their mixes and none, over a vocabulary with ties, large enough
    /// that the sorted prefix has to grow.
    #[test]
    fn filters_without_a_full_sort_give_the_same_distribution() {
        let mut s = 3u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as f32 / (1u64 << 31) as f32
        };
        let v = 5000;
        // Quantised values: many exact ties.
        let logits: Vec<f32> = (0..v).map(|_| ((next() * 40.0).round() - 20.0) * 0.25).collect();
        let flat: Vec<f32> = (0..v).map(|_| next() * 0.01).collect();
        for l in [&logits, &flat] {
            // Temperature 0 is a point mass, which the reference does not form.
            for &(t, top_k, top_p, min_p) in CHECKED_MIXES.iter().filter(|m| m.0 > 0.0) {
                let top_k = top_k as usize;
                let p = SamplingParams { temperature: t, top_k, top_p, min_p, seed: 5 };
                let got = Sampler::new(p.clone()).unwrap().probs(l).unwrap();
                let want = reference_probs(&p, l);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((*g as f64 - w).abs() <= 1e-6 * w.max(1e-30) + 1e-12, "{p:?}: token {i}: {g} vs {w}");
                }
                // And the draws follow it: a seeded draw picks only tokens the filters keep.
                let mut sm = Sampler::new(p.clone()).unwrap();
                for _ in 0..200 {
                    let tok = sm.sample(l).unwrap() as usize;
                    assert!(want[tok] > 0.0, "{p:?}: drew token {tok}, which the filters drop");
                }
            }
        }
    }

    /// Rows of 3,000 logits for the twin checks: quantised values (ties), a nearly flat row
    /// (large nuclei) and a peaked one.
    fn twin_rows(seed: u64) -> [Vec<f32>; 3] {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as f32 / (1u64 << 31) as f32
        };
        let v = 3000;
        let ties: Vec<f32> = (0..v).map(|_| ((next() * 40.0).round() - 20.0) * 0.25).collect();
        let flat: Vec<f32> = (0..v).map(|_| next() * 0.01).collect();
        let peaked: Vec<f32> = (0..v).map(|i| if i % 97 == 5 { 12.0 + next() } else { next() * 30.0 - 25.0 }).collect();
        [ties, flat, peaked]
    }

    /// The device's draw (its CPU twin, `dsv4_backend::draw::draw_row`) takes the host
    /// sampler's token from the same seed: the same generator stream, the same filters and
    /// walk order, weights apart by at most 2⁻⁴⁷ of the best one's. Over logits with ties,
    /// flat ones (large nuclei) and peaked ones, every filter mix and 100 draws each.
    #[test]
    fn device_draws_take_the_host_samplers_tokens() {
        let mut drawn = 0;
        for l in &twin_rows(9) {
            for &(t, top_k, top_p, min_p) in &CHECKED_MIXES {
                let top_k = top_k as usize;
                let p = SamplingParams { temperature: t, top_k, top_p, min_p, seed: drawn as u64 };
                let (mut host, mut dev) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p.clone()).unwrap());
                for _ in 0..100 {
                    let want = host.sample(l).unwrap();
                    let got = dsv4_backend::draw::draw_row(l, &dev.device_draw());
                    assert_eq!(got, want, "{p:?}");
                    drawn += 1;
                }
            }
        }
        assert_eq!(drawn, 300 * CHECKED_MIXES.len());
        assert_eq!(Sampler::greedy().device_draw(), Draw::GREEDY);
    }

    /// Position-keyed uniforms: a pure function of (seed, position), in [0, 1), different
    /// across positions and seeds, untouched by the sequential stream.
    #[test]
    fn uniforms_at_positions_are_reproducible_and_distinct() {
        let p = SamplingParams { temperature: 0.8, seed: 11, ..Default::default() };
        let (a, mut b) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p.clone()).unwrap());
        let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.71).cos()).collect();
        for _ in 0..5 {
            b.sample(&logits).unwrap();
        }
        let us: Vec<f64> = (0..1000).map(|q| a.uniform_at(q)).collect();
        assert!(us.iter().all(|u| (0.0..1.0).contains(u)));
        assert_eq!(us, (0..1000).map(|q| b.uniform_at(q)).collect::<Vec<_>>());
        // Out of order, the same values.
        assert_eq!(a.uniform_at(517), us[517]);
        assert_eq!(a.uniform_at(3), us[3]);
        let distinct: std::collections::HashSet<u64> = us.iter().map(|u| u.to_bits()).collect();
        assert_eq!(distinct.len(), us.len());
        let other = Sampler::new(SamplingParams { seed: 12, ..p }).unwrap();
        assert!((0..1000).filter(|&q| other.uniform_at(q) == us[q]).count() == 0);
        // Roughly uniform: the mean of 1000 draws within 5 standard errors of 1/2.
        let mean = us.iter().sum::<f64>() / us.len() as f64;
        assert!((mean - 0.5).abs() < 5.0 * (1.0 / 12.0f64 / 1000.0).sqrt(), "mean {mean}");
        // The draws take them: reproducible by position, and they vary with it.
        let toks: Vec<u32> = (0..200).map(|q| a.sample_at(&logits, q).unwrap()).collect();
        assert_eq!(toks, (0..200).map(|q| b.sample_at(&logits, q).unwrap()).collect::<Vec<_>>());
        assert!(toks.iter().collect::<std::collections::HashSet<_>>().len() > 1);
        assert_eq!(a.device_draw_at(9).u, us[9]);
        assert_eq!(Sampler::greedy().device_draw_at(9), Draw::GREEDY);
        assert_eq!(Sampler::greedy().sample_at(&[0.0, 2.0, 1.0], 4).unwrap(), 1);
        assert_eq!(a.sample_at(&[1.0, f32::INFINITY], 0), Err(SampleError::NonFinite { index: 1 }));
    }

    /// [`Sampler::device_draw_at`] through the device's CPU twin takes
    /// [`Sampler::sample_at`]'s token, as `device_draws_take_the_host_samplers_tokens` shows for
    /// the sequential stream: over every filter mix and 100 positions of three kinds of logits.
    #[test]
    fn device_draws_at_positions_take_the_host_tokens() {
        let mut drawn = 0;
        for l in &twin_rows(21) {
            for &(t, top_k, top_p, min_p) in &CHECKED_MIXES {
                let top_k = top_k as usize;
                let p = SamplingParams { temperature: t, top_k, top_p, min_p, seed: 1000 + drawn as u64 };
                let s = Sampler::new(p.clone()).unwrap();
                for pos in (0..100).map(|k| k * 37 + 5) {
                    let want = s.sample_at(l, pos).unwrap();
                    let got = dsv4_backend::draw::draw_row(l, &s.device_draw_at(pos));
                    assert_eq!(got, want, "{p:?} at position {pos}");
                    drawn += 1;
                }
            }
        }
        assert_eq!(drawn, 300 * CHECKED_MIXES.len());
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { temperature: -1.0, ..Default::default() }).is_err());
    }
}
