//! OpenAI-compatible endpoints: completions, chat completions and responses.

use crate::error::{ApiError, Flavor};
use crate::gen::{Finish, Gen, Piece, Usage};
use crate::params::Fields;
use crate::{now_secs, Shared};
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use dsv4_engine::{Request, TokenEvent};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// An SSE response from a stream of events; `[DONE]`-style terminators are the caller's.
pub fn sse(s: impl Stream<Item = SseEvent> + Send + 'static) -> Response {
    Sse::new(s.map(Ok::<_, std::convert::Infallible>)).keep_alive(KeepAlive::default()).into_response()
}

pub fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        _ => "stop",
    }
}

pub fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
}

/// Completions-style logprobs of a list of tokens.
fn completion_logprobs(s: &Shared, toks: &[TokenEvent]) -> Value {
    let piece = |id: u32| s.tok.decode(&[id], false).unwrap_or_default();
    json!({
        "tokens": toks.iter().map(|t| piece(t.id)).collect::<Vec<_>>(),
        "token_logprobs": toks.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": toks.iter().map(|t| {
            t.top.iter().map(|(id, lp)| (piece(*id), json!(lp))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
    })
}

/// Chat-style logprobs (`choices[].logprobs.content`).
pub fn chat_logprobs(s: &Shared, toks: &[TokenEvent]) -> Value {
    let piece = |id: u32| s.tok.decode(&[id], false).unwrap_or_default();
    let content: Vec<Value> = toks
        .iter()
        .map(|t| {
            let tp = piece(t.id);
            json!({"token": tp, "logprob": t.logprob, "bytes": tp.as_bytes(),
                   "top_logprobs": t.top.iter().map(|(id, lp)| {
                       let p = piece(*id);
                       json!({"token": p, "logprob": lp, "bytes": p.as_bytes()})
                   }).collect::<Vec<_>>()})
        })
        .collect();
    json!({"content": content})
}

/// Submits a tokenised request to the engine.
#[allow(clippy::too_many_arguments)]
pub fn start(
    s: &Shared,
    prompt: Vec<u32>,
    f: &Fields<'_>,
    max_tokens: usize,
    stop: Vec<String>,
    top_logprobs: Option<usize>,
    snapshot_at: Vec<usize>,
    id: u64,
) -> Result<Gen, ApiError> {
    s.guard.check_stops(&stop, f.flavor)?;
    let sampling = f.sampling(id)?;
    let n = prompt.len();
    // End of sequence, plus any `stop_token_ids` (vLLM's extension) the client adds.
    let mut stop_ids = s.engine.eos_ids.clone();
    match f.v.get("stop_token_ids") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for x in a {
                match x.as_u64() {
                    Some(id) if (id as usize) < s.engine.vocab_size => stop_ids.push(id as u32),
                    _ => {
                        return Err(ApiError::bad(
                            f.flavor,
                            format!("`stop_token_ids` entries must be token ids, found {x}"),
                        )
                        .param("stop_token_ids"))
                    }
                }
            }
        }
        Some(other) => {
            return Err(ApiError::bad(f.flavor, format!("`stop_token_ids` must be a list, found {other}"))
                .param("stop_token_ids"))
        }
    }
    let req = Request { prompt, sampling, max_tokens, stop_ids, top_logprobs, snapshot_at };
    let sub = s.engine.submit(req).map_err(|e| ApiError::from_admit(f.flavor, e))?;
    Ok(Gen::new(sub, &s.tok, stop, n))
}

fn check_n(f: &Fields<'_>) -> Result<(), ApiError> {
    match f.u64("n")? {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad(f.flavor, format!("n = {n} is not supported; use n = 1")).param("n")),
    }
}

pub async fn completions(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match completions_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let fl = Flavor::OpenAi;
    let v = s.body(&headers, body, fl).await?;
    s.check_model(&v, fl, false)?;
    let f = Fields::new(&v, fl);
    check_n(&f)?;
    if f.bool("echo")? {
        return Err(ApiError::bad(fl, "`echo` is not supported").param("echo"));
    }
    let special = f.bool("parse_special_tokens")?;
    let prompt: Vec<u32> = match v.get("prompt") {
        Some(Value::String(t)) => encode_raw(&s, t, special, fl)?,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            a.iter().map(|x| x.as_u64().unwrap_or(0).min(u32::MAX as u64) as u32).collect()
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            encode_raw(&s, a[0].as_str().unwrap_or(""), special, fl)?
        }
        Some(other) => {
            return Err(ApiError::bad(fl, format!("`prompt` must be a string or a list of token ids, found {other}"))
                .param("prompt"))
        }
        None => return Err(ApiError::bad(fl, "`prompt` is required").param("prompt")),
    };
    let max_tokens = f.positive("max_tokens")?.unwrap_or(16);
    let stop = f.strings("stop")?;
    let logprobs = f.u64("logprobs")?.map(|n| n.min(20) as usize);
    let stream = f.bool("stream")?;
    let include_usage = v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let id_n = next_id();
    let gen = start(&s, prompt, &f, max_tokens, stop, logprobs, Vec::new(), id_n)?;
    let id = format!("cmpl-{id_n}");
    let model = s.model_name.clone();
    let created = now_secs();
    if !stream {
        let (text, toks, fin, usage) = gen.collect().await.map_err(|e| server_error(fl, e))?;
        let lp = logprobs.map(|_| completion_logprobs(&s, &toks));
        return Ok(axum::Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish_reason(&fin)}],
            "usage": usage_json(&usage),
        }))
        .into_response());
    }
    let chunk = move |text: &str, lp: Value, fin: Value| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": fin}]})
    };
    let st = (gen, false, s.clone());
    let body = stream::unfold(st, move |(mut gen, ended, s)| {
        let chunk = chunk.clone();
        async move {
            if ended {
                return None;
            }
            let evs: Vec<SseEvent> = match gen.next().await {
                Some(Piece::Text(t, toks)) => {
                    let lp = if logprobs.is_some() { completion_logprobs(&s, &toks) } else { Value::Null };
                    vec![data(&chunk(&t, lp, Value::Null))]
                }
                Some(Piece::Done(fin, usage)) => {
                    let mut v = vec![data(&chunk("", Value::Null, json!(finish_reason(&fin))))];
                    if include_usage {
                        let mut u = chunk("", Value::Null, Value::Null);
                        u["choices"] = json!([]);
                        u["usage"] = usage_json(&usage);
                        v.push(data(&u));
                    }
                    v.push(SseEvent::default().data("[DONE]"));
                    return Some((stream::iter(v), (gen, true, s)));
                }
                Some(Piece::Error(e)) => {
                    let v = vec![data(&server_error(Flavor::OpenAi, e).body()), SseEvent::default().data("[DONE]")];
                    return Some((stream::iter(v), (gen, true, s)));
                }
                None => return None,
            };
            Some((stream::iter(evs), (gen, false, s)))
        }
    })
    .flatten();
    Ok(sse(body))
}

/// A raw prompt's ids. Special-token strings are plain text unless the request sets
/// `"parse_special_tokens": true` (a hand-rendered chat prompt: the earlier behaviour).
pub fn encode_raw(s: &Shared, text: &str, special: bool, fl: Flavor) -> Result<Vec<u32>, ApiError> {
    s.guard.encode(text.len(), fl, || {
        let r = if special {
            s.tok.encode(text, false)
        } else {
            s.tok.encode_with_literals(text, std::slice::from_ref(&(0..text.len())))
        };
        r.map_err(|e| e.to_string())
    })
}

pub fn server_error(fl: Flavor, e: String) -> ApiError {
    ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, fl, e)
}

pub async fn chat_completions(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match crate::openai_chat::chat_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub async fn responses(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match crate::openai_chat::responses_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub async fn tokenize(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match crate::openai_chat::tokenize_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}
