//! The host-side pass over one row's logits that some requests need before sampling: bias and
//! penalties (`penalties.rs`), then the grammar mask (`constraint.rs`). The engine calls
//! [`RowProcessor::apply`] and [`RowProcessor::accept`] around the sampler; nothing else there
//! knows about it.

use crate::constraint::{CompiledGrammar, ConstraintError, Grammar};
use crate::penalties::{Penalties, PenaltyParams};
use std::sync::Arc;

/// What a request asks of the row pass; the default does nothing.
#[derive(Clone, Debug, Default)]
pub struct LogitsSpec {
    pub penalties: PenaltyParams,
    pub grammar: Option<Arc<CompiledGrammar>>,
    /// The grammar starts after this token is sampled (the end of the reasoning).
    pub grammar_after: Option<u32>,
}

impl LogitsSpec {
    pub fn is_noop(&self) -> bool {
        self.penalties.is_noop() && self.grammar.is_none()
    }

    /// The live state for one sequence, or None when the row pass is not needed.
    pub fn start(&self, prompt: &[u32]) -> Option<RowProcessor> {
        if self.is_noop() {
            return None;
        }
        Some(RowProcessor {
            penalties: (!self.penalties.is_noop()).then(|| Penalties::new(self.penalties.clone(), prompt)),
            grammar: self.grammar.as_ref().map(|g| g.start(self.grammar_after)),
        })
    }
}

pub struct RowProcessor {
    penalties: Option<Penalties>,
    grammar: Option<Grammar>,
}

impl RowProcessor {
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        if let Some(p) = &self.penalties {
            p.apply(logits);
        }
        if let Some(g) = &mut self.grammar {
            g.apply(logits)?;
        }
        Ok(())
    }

    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        if let Some(p) = &mut self.penalties {
            p.accept(token);
        }
        if let Some(g) = &mut self.grammar {
            g.accept(token)?;
        }
        Ok(())
    }
}
