//! DSpark speculative drafting for DeepSeek V4 (spec `dspark.md`): the drafter written over
//! [`dsv4_backend::Backend`] ops, with the CPU f32 reference as its default instance.
//!
//! * [`Drafter`]: the `mtp.<s>.*` block drafter (context fusion `main_proj`/`main_norm`, one
//!   [`ContextRing`] row per stage and committed position, the non-causal γ-slot block through
//!   the SWA-only, score-routed draft stages, the shared LM head, the Markov head and the
//!   confidence head), with greedy or sampled left-to-right token choice.
//! * [`HiddenCapture`]: the target-side `main_hidden` tap (mean over the mHC streams of the
//!   output of each `dspark_target_layer_ids` layer) for `Model::forward_with`.
//! * [`verify`]: greedy and rejection-sampling acceptance of a verified block.
//!
//! A round (spec §4.3): `draft(anchor, P+1)` → verify `[anchor, d_0..d_{ℓ-1}]` in one target
//! forward with a [`HiddenCapture`] → accept `n` → cut the target back to `P+2+n` tokens →
//! `commit` the captured rows of positions `P+1..=P+1+n` → the bonus is the next anchor.

pub mod capture;
pub mod config;
pub mod drafter;
pub mod ring;
pub mod verify;
pub mod weights;

pub use capture::HiddenCapture;
pub use config::DsparkConfig;
pub use drafter::{Draft, DraftRequest, Drafter, Trace};
pub use ring::{ContextRing, Ring};

use dsv4_model::LoadError;

#[derive(Debug, thiserror::Error)]
pub enum DsparkError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("config.json: `{field}`: {msg}")]
    Config { field: String, msg: String },
    #[error(
        "the checkpoint carries a serial MTP module ({stages} `mtp.*` stage(s) with `e_proj`/`h_proj`, no \
         `mtp.0.main_proj`), not a DSpark drafter; DSpark needs e.g. DeepSeek-V4-Flash-DSpark or -0731"
    )]
    SerialMtp { stages: usize },
    #[error("not a DSpark checkpoint: {0}")]
    NotDspark(String),
    #[error("captured hidden rows must be {expected} wide (len(dspark_target_layer_ids) x hidden), got {found}")]
    HiddenWidth { expected: usize, found: usize },
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    Token { token: u32, vocab: usize },
    #[error("no context row for position {needed} (the ring's last committed position is {pos:?}); commit every committed row before drafting")]
    NoContext { pos: Option<usize>, needed: usize },
    #[error("the context ring was made for another drafter (stage count or row width differ)")]
    RingShape,
}
