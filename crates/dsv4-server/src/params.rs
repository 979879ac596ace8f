//! Typed reading of request fields with errors that name the field.

use crate::error::{ApiError, Flavor};
use dsv4_engine::SamplingParams;
use serde_json::Value;

pub struct Fields<'a> {
    pub v: &'a Value,
    pub flavor: Flavor,
}

impl<'a> Fields<'a> {
    pub fn new(v: &'a Value, flavor: Flavor) -> Self {
        Fields { v, flavor }
    }
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.v.get(k).filter(|x| !x.is_null())
    }
    fn err(&self, k: &str, msg: String) -> ApiError {
        ApiError::bad(self.flavor, msg).param(k)
    }
    pub fn f32(&self, k: &str) -> Result<Option<f32>, ApiError> {
        self.get(k)
            .map(|x| {
                x.as_f64().map(|f| f as f32).ok_or_else(|| self.err(k, format!("`{k}` must be a number, found {x}")))
            })
            .transpose()
    }
    pub fn u64(&self, k: &str) -> Result<Option<u64>, ApiError> {
        self.get(k)
            .map(|x| x.as_u64().ok_or_else(|| self.err(k, format!("`{k}` must be a non-negative integer, found {x}"))))
            .transpose()
    }
    /// A positive integer (max_tokens and friends): 0 or negative is a 400.
    pub fn positive(&self, k: &str) -> Result<Option<usize>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => match x.as_i64() {
                Some(n) if n >= 1 => Ok(Some(n as usize)),
                _ => Err(self.err(k, format!("`{k}` must be an integer >= 1, found {x}"))),
            },
        }
    }
    pub fn bool(&self, k: &str) -> Result<bool, ApiError> {
        match self.get(k) {
            None => Ok(false),
            Some(x) => x.as_bool().ok_or_else(|| self.err(k, format!("`{k}` must be true or false, found {x}"))),
        }
    }
    pub fn str(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(k)
            .map(|x| x.as_str().ok_or_else(|| self.err(k, format!("`{k}` must be a string, found {x}"))))
            .transpose()
    }
    /// A string or a list of strings (stop sequences).
    pub fn strings(&self, k: &str) -> Result<Vec<String>, ApiError> {
        match self.get(k) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str().map(str::to_string).ok_or_else(|| self.err(k, format!("`{k}` entries must be strings")))
                })
                .collect(),
            Some(x) => Err(self.err(k, format!("`{k}` must be a string or a list of strings, found {x}"))),
        }
    }

    /// temperature, top_p, top_k, min_p, seed with OpenAI/Anthropic defaults (temperature 1).
    pub fn sampling(&self, request_id: u64) -> Result<SamplingParams, ApiError> {
        let temperature = self.f32("temperature")?.unwrap_or(1.0);
        if !(0.0..=100.0).contains(&temperature) {
            return Err(self.err("temperature", format!("`temperature` must be in [0, 100], found {temperature}")));
        }
        let top_p = self.f32("top_p")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(self.err("top_p", format!("`top_p` must be in (0, 1], found {top_p}")));
        }
        let min_p = self.f32("min_p")?.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(self.err("min_p", format!("`min_p` must be in [0, 1], found {min_p}")));
        }
        let top_k = match self.get("top_k") {
            None => 0,
            Some(x) => match x.as_i64() {
                Some(n) if n <= 0 => 0,
                Some(n) => n as usize,
                None => return Err(self.err("top_k", format!("`top_k` must be an integer, found {x}"))),
            },
        };
        let seed = match self.get("seed") {
            // A fresh seed each time: the same prompt must not give the same answer after
            // every restart.
            None => crate::ops::random_u64() ^ request_id,
            Some(x) => x
                .as_i64()
                .map(|s| s as u64)
                .or_else(|| x.as_u64())
                .ok_or_else(|| self.err("seed", format!("`seed` must be an integer, found {x}")))?,
        };
        Ok(SamplingParams { temperature, top_p, top_k, min_p, seed })
    }
}
