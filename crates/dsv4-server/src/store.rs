//! Stored Responses (`store`, `previous_response_id`, `GET /v1/responses/{id}`): a bounded
//! in-memory map; the oldest entries go first. Nothing survives a restart.

use crate::error::{ApiError, Flavor};
use crate::Shared;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use dsv4_chat::Message;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// A finished response: the conversation that led to it (its output included) and its JSON.
pub struct Stored {
    pub messages: Vec<Message>,
    pub response: Value,
}

/// The entries and their ids, oldest first.
type Entries = (HashMap<String, Arc<Stored>>, VecDeque<String>);

pub struct ResponseStore {
    cap: usize,
    inner: Mutex<Entries>,
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::new(1024)
    }
}

impl ResponseStore {
    pub fn new(cap: usize) -> Self {
        ResponseStore { cap: cap.max(1), inner: Mutex::new((HashMap::new(), VecDeque::new())) }
    }
    pub fn put(&self, id: String, s: Stored) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.0.insert(id.clone(), Arc::new(s)).is_none() {
            g.1.push_back(id);
        }
        while g.1.len() > self.cap {
            if let Some(old) = g.1.pop_front() {
                g.0.remove(&old);
            }
        }
    }
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).0.get(id).cloned()
    }
    pub fn remove(&self, id: &str) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let found = g.0.remove(id).is_some();
        g.1.retain(|x| x != id);
        found
    }
}

fn unknown(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, Flavor::OpenAi, format!("no stored response with id `{id}`"))
}

/// The conversation of a stored response, for `previous_response_id`.
pub fn previous(s: &Shared, id: &str) -> Result<Vec<Message>, ApiError> {
    s.live.responses.get(id).map(|r| r.messages.clone()).ok_or_else(|| unknown(id).param("previous_response_id"))
}

pub async fn get_response(State(s): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = s.authorize(&headers, Flavor::OpenAi) {
        return e.into_response();
    }
    match s.live.responses.get(&id) {
        Some(r) => axum::Json(r.response.clone()).into_response(),
        None => unknown(&id).into_response(),
    }
}

pub async fn delete_response(State(s): State<Shared>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = s.authorize(&headers, Flavor::OpenAi) {
        return e.into_response();
    }
    if s.live.responses.remove(&id) {
        axum::Json(serde_json::json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        unknown(&id).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_entries_are_evicted() {
        let st = ResponseStore::new(2);
        for i in 0..3 {
            st.put(format!("r{i}"), Stored { messages: vec![], response: Value::Null });
        }
        assert!(st.get("r0").is_none() && st.get("r1").is_some() && st.get("r2").is_some());
        assert!(st.remove("r1") && !st.remove("r1"));
    }
}
