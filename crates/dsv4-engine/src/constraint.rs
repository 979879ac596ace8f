//! Grammar-constrained decoding with `llguidance` (the engine vLLM, SGLang and llama.cpp use):
//! JSON schemas, any-JSON-object and Lark grammars (forced DSML tool calls are built as Lark).
//! A constraint masks one row's logits before sampling and advances on the sampled token; with
//! thinking on it waits for the end-of-reasoning token, so only the answer is constrained.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConstraintError {
    #[error("cannot build the token trie from tokenizer.json: {0}")]
    Tokenizer(String),
    #[error("invalid grammar or schema: {0}")]
    Grammar(String),
    #[error("constrained decoding failed: {0}")]
    Decode(String),
}

/// What the output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`json_schema`, Responses `text.format`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// Compact JSON unless the schema asks otherwise: a model (the random demo one above all) that
/// may emit whitespace between tokens forever would never finish.
fn compact(mut schema: Value) -> Value {
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

impl GrammarSpec {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The tokenizer as llguidance sees it (a byte trie over the vocabulary); built once per model.
pub struct GrammarEnv {
    factory: ParserFactory,
}

impl GrammarEnv {
    /// From a HF `tokenizer.json` (byte-level BPE); `vocab_size` is the model's (rows past the
    /// tokenizer's ids are never allowed).
    /// Every added token (chat markers such as `</think>` and `｜DSML｜` included) counts as
    /// special: never allowed as text (inside a JSON string it would end the answer's parse),
    /// only where a grammar names it by id (`<[id]>` in Lark).
    pub fn from_tokenizer_json(json: &Value, vocab_size: usize, eos: u32) -> Result<Self, ConstraintError> {
        let mut json = json.clone();
        if let Some(added) = json.get_mut("added_tokens").and_then(Value::as_array_mut) {
            for t in added {
                t["special"] = Value::Bool(true);
            }
        }
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| ConstraintError::Tokenizer(format!("{e:#}")))?;
        words.resize(vocab_size.max(words.len()), Vec::new());
        let info = TokRxInfo::new(words.len() as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Tokenizer(format!("{e:#}")))?;
        factory.quiet();
        Ok(GrammarEnv { factory })
    }

    /// Compiles a grammar once (errors here are the client's: a 400).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, ConstraintError> {
        let parser =
            self.factory.create_parser(spec.top_level()).map_err(|e| ConstraintError::Grammar(format!("{e:#}")))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(ConstraintError::Grammar(e));
        }
        Ok(CompiledGrammar { proto: Mutex::new(m) })
    }
}

/// A compiled grammar; each sequence that uses it gets its own copy of the parser.
pub struct CompiledGrammar {
    proto: Mutex<Matcher>,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledGrammar")
    }
}

impl CompiledGrammar {
    /// A fresh parser state; `after`: stay inactive until this token has been sampled.
    pub fn start(&self, after: Option<u32>) -> Grammar {
        let m = self.proto.lock().unwrap_or_else(|p| p.into_inner()).deep_clone();
        Grammar { matcher: m, after, active: after.is_none() }
    }

    /// Whether `tokens` (a whole completion, EOS excluded) is a complete match; for tests.
    pub fn accepts(&self, tokens: &[u32]) -> bool {
        let mut g = self.start(None);
        tokens.iter().all(|&t| g.accept(t).is_ok()) && g.matcher.is_accepting().unwrap_or(false)
    }
}

/// One sequence's parser state.
pub struct Grammar {
    matcher: Matcher,
    after: Option<u32>,
    active: bool,
}

/// The value masked tokens get: finite (the sampler refuses non-finite logits) and far below
/// anything a model produces.
const MASKED: f32 = -1e30;

impl Grammar {
    /// Masks every token the grammar does not allow next (only EOS once it is complete).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        if !self.active {
            return Ok(());
        }
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| ConstraintError::Decode(format!("{e:#}")))?;
        let mut any = false;
        for (i, x) in logits.iter_mut().enumerate() {
            if mask.is_allowed(i as u32) {
                any = true;
            } else {
                *x = MASKED;
            }
        }
        if !any {
            return Err(ConstraintError::Decode("the grammar allows no token here".into()));
        }
        Ok(())
    }

    /// Advances on the sampled token.
    pub fn accept(&mut self, token: u32) -> Result<(), ConstraintError> {
        if !self.active {
            self.active = self.after == Some(token);
            return Ok(());
        }
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| ConstraintError::Decode(format!("{e:#}")))
    }
}
