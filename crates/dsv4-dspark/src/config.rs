//! DSpark configuration keys (`dspark_*` in both `config.json` layouts, spec §2.3).

use serde_json::Value;

use crate::DsparkError;

/// The drafter's own settings; everything else (dimensions, norms, mHC, MoE) is the target's
/// [`dsv4_model::Config`]. The stage count is not here: it comes from the checkpoint's
/// `mtp.<i>.` tensors (spec §2.3 rule 2), see [`crate::Drafter::n_stages`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DsparkConfig {
    /// `dspark_block_size` γ: block slots per draft (V4: 5).
    pub block_size: usize,
    /// `dspark_noise_token_id`: the token filling block slots 1..γ.
    pub noise_token_id: u32,
    /// `dspark_target_layer_ids`: target layers whose outputs are captured (ascending).
    pub target_layer_ids: Vec<usize>,
    /// `dspark_markov_rank` r.
    pub markov_rank: usize,
}

fn field(key: &str, msg: impl Into<String>) -> DsparkError {
    DsparkError::Config { field: key.to_string(), msg: msg.into() }
}

impl DsparkConfig {
    /// Reads the `dspark_*` keys of a `config.json` (HF or official layout). `Ok(None)` when the
    /// checkpoint is not a DSpark one (no `dspark_block_size`, or 0).
    pub fn from_json(v: &Value, n_layers: usize, vocab: usize) -> Result<Option<Self>, DsparkError> {
        let map = v.as_object().ok_or_else(|| field("config.json", "not a JSON object"))?;
        let get = |k: &str| map.get(k).filter(|x| !x.is_null());
        let uint = |k: &str| -> Result<Option<usize>, DsparkError> {
            get(k)
                .map(|x| {
                    x.as_u64().map(|u| u as usize).ok_or_else(|| field(k, format!("expected an integer, found {x}")))
                })
                .transpose()
        };
        let block_size = match uint("dspark_block_size")? {
            None | Some(0) => return Ok(None),
            Some(b) => b,
        };
        let noise = uint("dspark_noise_token_id")?.ok_or_else(|| field("dspark_noise_token_id", "missing"))?;
        if noise >= vocab {
            return Err(field("dspark_noise_token_id", format!("{noise} is outside the vocabulary (size {vocab})")));
        }
        let layers: Vec<usize> = match get("dspark_target_layer_ids") {
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_u64()
                        .map(|u| u as usize)
                        .ok_or_else(|| field(&format!("dspark_target_layer_ids[{i}]"), format!("not an integer: {x}")))
                })
                .collect::<Result<_, _>>()?,
            Some(x) => return Err(field("dspark_target_layer_ids", format!("expected a list, found {x}"))),
            None => return Err(field("dspark_target_layer_ids", "missing")),
        };
        if layers.is_empty() {
            return Err(field("dspark_target_layer_ids", "is empty"));
        }
        if layers.windows(2).any(|w| w[0] >= w[1]) {
            return Err(field("dspark_target_layer_ids", format!("{layers:?} is not strictly ascending")));
        }
        if let Some(&l) = layers.iter().find(|&&l| l >= n_layers) {
            return Err(field(
                "dspark_target_layer_ids",
                format!("layer {l} does not exist (the target has {n_layers})"),
            ));
        }
        let markov_rank = uint("dspark_markov_rank")?.ok_or_else(|| field("dspark_markov_rank", "missing"))?;
        if markov_rank == 0 {
            return Err(field("dspark_markov_rank", "must be > 0"));
        }
        Ok(Some(DsparkConfig { block_size, noise_token_id: noise as u32, target_layer_ids: layers, markov_rank }))
    }
}
