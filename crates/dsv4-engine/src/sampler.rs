//! Token sampling: greedy, temperature, top-k, top-p and min-p, reproducible from a seed.

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

    /// Candidates sorted by scaled logit, their probabilities and how many survive the filters.
    fn filtered(&self, logits: &[f32]) -> (Vec<(u32, f32)>, Vec<f64>, usize) {
        let p = &self.params;
        // Sorted by the raw logit (same order for any temperature > 0) and scaled after
        // subtracting the maximum, in f64: a tiny temperature then gives -inf (probability 0),
        // never inf - inf = NaN.
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
        (cand, probs, keep)
    }

    /// Picks the next token. Non-finite logits are an error, never a silent token.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        if let Some(index) = logits.iter().position(|v| !v.is_finite()) {
            return Err(SampleError::NonFinite { index });
        }
        let p = &self.params;
        if p.temperature == 0.0 {
            return Ok(argmax_margin(logits).0);
        }
        let (cand, probs, keep) = self.filtered(logits);
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.gen::<f64>() * mass;
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

    #[test]
    fn bad_params_are_rejected() {
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { temperature: -1.0, ..Default::default() }).is_err());
    }
}
