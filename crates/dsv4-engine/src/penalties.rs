//! Per-request adjustments of one row's logits before sampling: OpenAI's `logit_bias`, the
//! additive presence and frequency penalties (over generated tokens, as OpenAI defines them) and
//! the multiplicative repetition penalty (over prompt and generated tokens, as HF and vLLM apply
//! it). Kept apart from the sampler so a GPU sampler can leave such rows to the host.

use std::collections::{HashMap, HashSet};

/// What a request asks for; the default changes nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct PenaltyParams {
    /// Added to the logit of each listed token.
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted once from every token generated at least once.
    pub presence: f32,
    /// Subtracted per occurrence among the generated tokens.
    pub frequency: f32,
    /// > 1 discourages every token seen in the prompt or the output; 1 is off.
    pub repetition: f32,
}

impl Default for PenaltyParams {
    fn default() -> Self {
        PenaltyParams { logit_bias: Vec::new(), presence: 0.0, frequency: 0.0, repetition: 1.0 }
    }
}

impl PenaltyParams {
    /// True when applying these would change nothing (the row can skip the host pass).
    pub fn is_noop(&self) -> bool {
        self.logit_bias.is_empty() && self.presence == 0.0 && self.frequency == 0.0 && self.repetition == 1.0
    }
}

/// The live state of one sequence's penalties.
pub struct Penalties {
    params: PenaltyParams,
    generated: HashMap<u32, u32>,
    /// Prompt tokens (only kept for the repetition penalty).
    prompt: HashSet<u32>,
}

impl Penalties {
    pub fn new(params: PenaltyParams, prompt: &[u32]) -> Self {
        let prompt = if params.repetition != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Penalties { params, generated: HashMap::new(), prompt }
    }

    /// Adjusts the row in place; ids outside the row are ignored (validated at the door).
    pub fn apply(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            if let Some(x) = logits.get_mut(t as usize) {
                *x += b;
            }
        }
        if p.repetition != 1.0 {
            for &t in self.prompt.iter().chain(self.generated.keys()) {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x = if *x > 0.0 { *x / p.repetition } else { *x * p.repetition };
                }
            }
        }
        if p.presence != 0.0 || p.frequency != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(x) = logits.get_mut(t as usize) {
                    *x -= p.presence + p.frequency * n as f32;
                }
            }
        }
    }

    pub fn accept(&mut self, token: u32) {
        *self.generated.entry(token).or_insert(0) += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_presence_frequency_and_repetition() {
        let params = PenaltyParams { logit_bias: vec![(0, 5.0)], presence: 0.5, frequency: 0.25, repetition: 2.0 };
        let mut p = Penalties::new(params, &[3]);
        p.accept(1);
        p.accept(1);
        p.accept(2);
        let mut l = vec![1.0, 4.0, -1.0, 6.0, 1.0];
        p.apply(&mut l);
        // token 1: 4/2 - 0.5 - 2*0.25; token 2: -1*2 - 0.5 - 0.25; token 3 (prompt): 6/2.
        assert_eq!(l, vec![6.0, 1.0, -2.75, 3.0, 1.0]);
        assert!(PenaltyParams::default().is_noop());
    }
}
