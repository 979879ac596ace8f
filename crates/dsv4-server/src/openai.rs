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
use dsv4_engine::{GrammarSpec, LogitsSpec, PenaltyParams, Request, TokenEvent};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

/// How one generation is asked for (everything but the prompt).
#[derive(Clone, Default)]
pub struct StartOpts {
    /// None: `--default-max-tokens`, else the remaining context. Always clamped to what the
    /// context leaves (the finish reason is then `length`).
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub top_logprobs: Option<usize>,
    pub snapshot_at: Vec<usize>,
    pub logits: LogitsSpec,
    /// Which of `n` choices (added to the seed).
    pub choice: u64,
}

/// `n` (1 to 16).
pub fn n_choices(f: &Fields<'_>) -> Result<usize, ApiError> {
    match f.u64("n")? {
        None => Ok(1),
        Some(n @ 1..=16) => Ok(n as usize),
        Some(n) => Err(ApiError::bad(f.flavor, format!("`n` must be between 1 and 16, found {n}")).param("n")),
    }
}

/// Bias, penalties and the grammar (compiled here, so a bad schema is the client's 400); with
/// thinking on, the grammar waits for the end of the reasoning.
pub fn logits_spec(
    s: &Shared,
    f: &Fields<'_>,
    grammar: Option<GrammarSpec>,
    thinking: bool,
) -> Result<LogitsSpec, ApiError> {
    let fl = f.flavor;
    let bad = |k: &str, m: String| ApiError::bad(fl, m).param(k);
    let mut p = PenaltyParams::default();
    for (k, slot) in [("presence_penalty", &mut p.presence), ("frequency_penalty", &mut p.frequency)] {
        if let Some(x) = f.f32(k)? {
            if !(-2.0..=2.0).contains(&x) {
                return Err(bad(k, format!("`{k}` must be in [-2, 2], found {x}")));
            }
            *slot = x;
        }
    }
    if let Some(x) = f.f32("repetition_penalty")? {
        if !(x > 0.0 && x <= 10.0) {
            return Err(bad("repetition_penalty", format!("`repetition_penalty` must be in (0, 10], found {x}")));
        }
        p.repetition = x;
    }
    match f.v.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, v) in m {
                let id =
                    k.trim().parse::<u32>().ok().filter(|&t| (t as usize) < s.engine.vocab_size).ok_or_else(|| {
                        bad(
                            "logit_bias",
                            format!("`logit_bias` keys must be token ids below {}, found `{k}`", s.engine.vocab_size),
                        )
                    })?;
                let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                    bad("logit_bias", format!("`logit_bias` values must be numbers in [-100, 100], found {v}"))
                })?;
                p.logit_bias.push((id, b as f32));
            }
        }
        Some(other) => return Err(bad("logit_bias", format!("`logit_bias` must be an object, found {other}"))),
    }
    let grammar = match grammar {
        None => None,
        Some(g) => Some(Arc::new(s.grammar_env(fl)?.compile(&g).map_err(|e| ApiError::bad(fl, e.to_string()))?)),
    };
    let grammar_after = (thinking && grammar.is_some()).then_some(s.tok.special.think_end);
    Ok(LogitsSpec { penalties: p, grammar, grammar_after })
}

/// Submits a tokenised request to the engine.
pub fn start(s: &Shared, prompt: Vec<u32>, f: &Fields<'_>, o: &StartOpts, id: u64) -> Result<Gen, ApiError> {
    s.guard.check_stops(&o.stop, f.flavor)?;
    let mut sampling = f.sampling(id)?;
    sampling.seed = sampling.seed.wrapping_add(o.choice);
    let n = prompt.len();
    let limit = s.engine.config.max_context;
    let room = limit.saturating_sub(n);
    if room == 0 {
        return Err(ApiError::bad(
            f.flavor,
            format!("the prompt ({n} tokens) leaves no room in the context limit of {limit} tokens"),
        ));
    }
    let room = room.min(s.max_tokens_limit.unwrap_or(usize::MAX)).max(1);
    let max_tokens = o.max_tokens.or(s.default_max_tokens).unwrap_or(room).min(room);
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
    let req = Request {
        prompt,
        sampling,
        max_tokens,
        stop_ids,
        top_logprobs: o.top_logprobs,
        snapshot_at: o.snapshot_at.clone(),
        logits: o.logits.clone(),
    };
    let sub = s.engine.submit(req).map_err(|e| ApiError::from_admit(f.flavor, e))?;
    Ok(Gen::new(sub, &s.tok, o.stop.clone(), n))
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
    let model = s.check_model(&v, fl, false)?;
    let f = Fields::new(&v, fl);
    let n = n_choices(&f)?;
    let echo = f.bool("echo")?;
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
    let logprobs = f.u64("logprobs")?.map(|n| n.min(20) as usize);
    if echo && logprobs.is_some() {
        return Err(ApiError::bad(fl, "`echo` with `logprobs` is not supported (no prompt logprobs)").param("echo"));
    }
    // Echo returns the prompt as text before the completion.
    let echoed = if echo {
        s.tok.decode(&prompt, false).map_err(|e| ApiError::bad(fl, e.to_string()).param("prompt"))?
    } else {
        String::new()
    };
    let grammar = crate::structured::response_format(fl, v.get("response_format"), "response_format")?;
    let mut o = StartOpts {
        max_tokens: Some(f.positive("max_tokens")?.unwrap_or(16)),
        stop: f.strings("stop")?,
        top_logprobs: logprobs,
        logits: logits_spec(&s, &f, grammar, false)?,
        ..Default::default()
    };
    let stream = f.bool("stream")?;
    let include_usage = v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let id_n = next_id();
    let mut gens = Vec::new();
    for i in 0..n {
        o.choice = i as u64;
        gens.push(start(&s, prompt.clone(), &f, &o, id_n)?);
    }
    let id = format!("cmpl-{id_n}");
    let created = now_secs();
    if !stream {
        let results = futures_util::future::join_all(gens.into_iter().map(Gen::collect)).await;
        let (mut choices, mut total) = (Vec::new(), Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 });
        for (i, r) in results.into_iter().enumerate() {
            let (text, toks, fin, usage) = r.map_err(|e| server_error(fl, e))?;
            let lp = logprobs.map(|_| completion_logprobs(&s, &toks));
            choices.push(json!({"text": format!("{echoed}{text}"), "index": i, "logprobs": lp, "finish_reason": finish_reason(&fin)}));
            add_usage(&mut total, &usage, i == 0);
        }
        return Ok(axum::Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_json(&total),
        }))
        .into_response());
    }
    let chunk = move |index: usize, text: &str, lp: Value, fin: Value| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"text": text, "index": index, "logprobs": lp, "finish_reason": fin}]})
    };
    let total = Arc::new(Mutex::new(Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 }));
    let streams = gens
        .into_iter()
        .enumerate()
        .map(|(index, gen)| {
            let (chunk, total, s) = (chunk.clone(), total.clone(), s.clone());
            let head = (!echoed.is_empty()).then(|| data(&chunk(index, &echoed, Value::Null, Value::Null)));
            let body = stream::unfold((gen, false), move |(mut gen, ended)| {
                let (chunk, total, s) = (chunk.clone(), total.clone(), s.clone());
                async move {
                    if ended {
                        return None;
                    }
                    let evs: Vec<SseEvent> = match gen.next().await {
                        Some(Piece::Text(t, toks)) => {
                            let lp = if logprobs.is_some() { completion_logprobs(&s, &toks) } else { Value::Null };
                            vec![data(&chunk(index, &t, lp, Value::Null))]
                        }
                        Some(Piece::Done(fin, usage)) => {
                            add_usage(&mut total.lock().unwrap_or_else(|p| p.into_inner()), &usage, index == 0);
                            return Some((
                                stream::iter(vec![data(&chunk(index, "", Value::Null, json!(finish_reason(&fin))))]),
                                (gen, true),
                            ));
                        }
                        Some(Piece::Error(e)) => {
                            return Some((
                                stream::iter(vec![data(&server_error(Flavor::OpenAi, e).body())]),
                                (gen, true),
                            ));
                        }
                        None => return None,
                    };
                    Some((stream::iter(evs), (gen, false)))
                }
            })
            .flatten();
            stream::iter(head).chain(body).boxed()
        })
        .collect::<Vec<_>>();
    let tail = stream::once(async move {
        let mut v = Vec::new();
        if include_usage {
            let mut u = chunk(0, "", Value::Null, Value::Null);
            u["choices"] = json!([]);
            u["usage"] = usage_json(&total.lock().unwrap_or_else(|p| p.into_inner()));
            v.push(data(&u));
        }
        v.push(SseEvent::default().data("[DONE]"));
        stream::iter(v)
    })
    .flatten();
    Ok(sse(stream::select_all(streams).chain(tail)))
}

/// Sums the usage of `n` choices of one prompt (the prompt counts once).
pub fn add_usage(total: &mut Usage, u: &Usage, first: bool) {
    if first {
        total.prompt_tokens = u.prompt_tokens;
        total.cached_tokens = u.cached_tokens;
    }
    total.completion_tokens += u.completion_tokens;
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
