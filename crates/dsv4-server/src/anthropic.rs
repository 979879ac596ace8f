//! Anthropic Messages API (`/v1/messages`), with its streaming event sequence.

use crate::chat::{start_chat, tool_from, ChatEvent, Conversation};
use crate::error::{ApiError, Flavor};
use crate::gen::{Finish, Usage};
use crate::openai::{next_id, server_error, sse};
use crate::params::Fields;
use crate::Shared;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use dsv4_chat::{Message, Role, ToolCall};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

const FL: Flavor = Flavor::Anthropic;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad(FL, msg)
}

/// Text of an Anthropic `content` (string or blocks of type `text`).
fn block_text(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => out.push_str(
                        b.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad(format!("`{field}`: text block without text")))?,
                    ),
                    Some(t) => return Err(bad(format!("`{field}`: block type `{t}` is not supported here"))),
                    None => return Err(bad(format!("`{field}`: every block needs a `type`"))),
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        other => Err(bad(format!("`{field}` must be a string or a list of blocks, found {other}"))),
    }
}

fn convert_messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::new();
    match v.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => out.push(Message::system(block_text(s, "system")?)),
    }
    let arr = match v.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(bad("`messages` must not be empty")),
        Some(other) => return Err(bad(format!("`messages` must be a list, found {other}"))),
        None => return Err(bad("`messages` is required")),
    };
    for (i, m) in arr.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let content = m.get("content").ok_or_else(|| bad(format!("`{field}.content` is required")))?;
        match role {
            "user" => {
                let blocks = match content {
                    Value::String(s) => vec![json!({"type": "text", "text": s})],
                    Value::Array(b) => b.clone(),
                    other => return Err(bad(format!("`{field}.content` must be a string or blocks, found {other}"))),
                };
                let mut text = String::new();
                for b in &blocks {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                        Some("tool_result") => {
                            let id = b
                                .get("tool_use_id")
                                .and_then(Value::as_str)
                                .ok_or_else(|| bad(format!("`{field}`: tool_result needs tool_use_id")))?;
                            let c = block_text(b.get("content").unwrap_or(&Value::Null), &field)?;
                            out.push(Message::tool(id, c));
                        }
                        Some(t) => {
                            return Err(bad(format!(
                                "`{field}`: block type `{t}` is not supported (text and tool_result only)"
                            )))
                        }
                        None => return Err(bad(format!("`{field}`: every block needs a `type`"))),
                    }
                }
                if !text.is_empty()
                    || !blocks.iter().any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
                {
                    out.push(Message::user(text));
                }
            }
            "assistant" => {
                let mut msg = Message::assistant("");
                match content {
                    Value::String(s) => msg.content = s.clone(),
                    Value::Array(blocks) => {
                        for b in blocks {
                            match b.get("type").and_then(Value::as_str) {
                                Some("text") => {
                                    msg.content.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                                }
                                Some("thinking") => {
                                    let t = b.get("thinking").and_then(Value::as_str).unwrap_or("");
                                    msg.reasoning_content.get_or_insert_with(String::new).push_str(t);
                                }
                                Some("redacted_thinking") => {}
                                Some("tool_use") => msg.tool_calls.push(ToolCall {
                                    id: b.get("id").and_then(Value::as_str).unwrap_or("").to_string(),
                                    name: b
                                        .get("name")
                                        .and_then(Value::as_str)
                                        .ok_or_else(|| bad(format!("`{field}`: tool_use needs a name")))?
                                        .to_string(),
                                    arguments: b.get("input").cloned().unwrap_or(json!({})).to_string(),
                                }),
                                Some(t) => return Err(bad(format!("`{field}`: block type `{t}` is not supported"))),
                                None => return Err(bad(format!("`{field}`: every block needs a `type`"))),
                            }
                        }
                    }
                    other => return Err(bad(format!("`{field}.content` must be a string or blocks, found {other}"))),
                }
                out.push(msg);
            }
            other => return Err(bad(format!("`{field}.role` must be `user` or `assistant`, found `{other}`"))),
        }
    }
    if !out.iter().any(|m| m.role != Role::System) {
        return Err(bad("`messages` must hold at least one user or assistant message"));
    }
    Ok(out)
}

fn stop_reason(f: &Finish, tools: usize) -> (&'static str, Value) {
    match f {
        Finish::Length => ("max_tokens", Value::Null),
        Finish::StopSequence(s) => ("stop_sequence", json!(s)),
        _ if tools > 0 => ("tool_use", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

pub async fn messages(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    s.check_model(&v, FL, true)?;
    let f = Fields::new(&v, FL);
    let max_tokens = f.positive("max_tokens")?.ok_or_else(|| bad("`max_tokens` is required").param("max_tokens"))?;
    let thinking = match v.get("thinking") {
        None | Some(Value::Null) => false,
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") | Some("adaptive") => true,
            Some("disabled") => false,
            _ => {
                return Err(bad(format!("`thinking` must be {{\"type\": \"enabled\" | \"disabled\"}}, found {t}"))
                    .param("thinking"))
            }
        },
    };
    let tools = match v.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| match t.get("input_schema") {
                Some(Value::Object(_)) => tool_from(FL, t.get("name"), t.get("description"), t.get("input_schema")),
                _ => Err(bad("every tool needs an `input_schema` object").param("tools")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("`tools` must be a list, found {other}")).param("tools")),
    };
    let tools = if v.pointer("/tool_choice/type").and_then(Value::as_str) == Some("none") { Vec::new() } else { tools };
    let conv = Conversation { messages: convert_messages(&v)?, tools, thinking, reasoning_effort: None };
    let stop = f.strings("stop_sequences")?;
    let stream = f.bool("stream")?;
    let idn = next_id();
    let g = start_chat(&s, &conv, &f, max_tokens, stop, None, idn)?;
    let (id, model) = (format!("msg_{idn}"), s.model_name.clone());
    if !stream {
        let r = g.collect().await.map_err(|e| server_error(FL, e))?;
        let mut content = Vec::new();
        if thinking {
            content.push(json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}));
        }
        if !r.content.is_empty() || r.tool_calls.is_empty() {
            content.push(json!({"type": "text", "text": r.content}));
        }
        for (tid, name, args) in &r.tool_calls {
            let input: Value = serde_json::from_str(args).unwrap_or(json!({}));
            content.push(json!({"type": "tool_use", "id": tid, "name": name, "input": input}));
        }
        let u = r.usage.unwrap_or(Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 });
        let (reason, seq) = stop_reason(&r.finish.unwrap_or(Finish::Stop), r.tool_calls.len());
        return Ok(axum::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
                      "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0},
        }))
        .into_response());
    }
    let ev = |name: &str, v: Value| SseEvent::default().event(name).data(v.to_string());
    let start = ev(
        "message_start",
        json!({"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
    );
    /// Which content block is open.
    #[derive(PartialEq)]
    enum Open {
        None,
        Thinking,
        Text,
        Tool,
    }
    struct St {
        open: Open,
        index: usize,
    }
    fn close(st: &mut St, out: &mut Vec<SseEvent>) {
        if st.open != Open::None {
            if st.open == Open::Thinking {
                out.push(SseEvent::default().event("content_block_delta").data(
                    json!({"type": "content_block_delta", "index": st.index, "delta": {"type": "signature_delta", "signature": ""}}).to_string(),
                ));
            }
            out.push(
                SseEvent::default()
                    .event("content_block_stop")
                    .data(json!({"type": "content_block_stop", "index": st.index}).to_string()),
            );
            st.index += 1;
            st.open = Open::None;
        }
    }
    fn open(st: &mut St, want: Open, block: Value, out: &mut Vec<SseEvent>) {
        close(st, out);
        out.push(
            SseEvent::default()
                .event("content_block_start")
                .data(json!({"type": "content_block_start", "index": st.index, "content_block": block}).to_string()),
        );
        st.open = want;
    }
    let state = (g, St { open: Open::None, index: 0 }, false);
    let rest = stream::unfold(state, |(mut g, mut st, ended)| async move {
        if ended {
            return None;
        }
        let e = g.next().await?;
        let mut out = Vec::new();
        let delta = |st: &St, d: Value| {
            SseEvent::default()
                .event("content_block_delta")
                .data(json!({"type": "content_block_delta", "index": st.index, "delta": d}).to_string())
        };
        match e {
            ChatEvent::Reasoning(t) => {
                if st.open != Open::Thinking {
                    open(
                        &mut st,
                        Open::Thinking,
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                        &mut out,
                    );
                }
                out.push(delta(&st, json!({"type": "thinking_delta", "thinking": t})));
            }
            ChatEvent::Content(t) => {
                if st.open != Open::Text {
                    open(&mut st, Open::Text, json!({"type": "text", "text": ""}), &mut out);
                }
                out.push(delta(&st, json!({"type": "text_delta", "text": t})));
            }
            ChatEvent::ToolStart { id, name, .. } => {
                open(&mut st, Open::Tool, json!({"type": "tool_use", "id": id, "name": name, "input": {}}), &mut out);
            }
            ChatEvent::ToolArgs { delta: d, .. } => {
                out.push(delta(&st, json!({"type": "input_json_delta", "partial_json": d})))
            }
            ChatEvent::ToolEnd { .. } => close(&mut st, &mut out),
            ChatEvent::Tokens(_) => {}
            ChatEvent::Done { finish, usage, tool_calls } => {
                if st.index == 0 && st.open == Open::None {
                    // Always at least one (possibly empty) text block, like the API.
                    open(&mut st, Open::Text, json!({"type": "text", "text": ""}), &mut out);
                }
                close(&mut st, &mut out);
                let (reason, seq) = stop_reason(&finish, tool_calls);
                out.push(
                    SseEvent::default().event("message_delta").data(
                        json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}})
                        .to_string(),
                    ),
                );
                out.push(SseEvent::default().event("message_stop").data(json!({"type": "message_stop"}).to_string()));
                return Some((stream::iter(out), (g, st, true)));
            }
            ChatEvent::Error(e) => {
                out.push(SseEvent::default().event("error").data(server_error(FL, e).body().to_string()));
                return Some((stream::iter(out), (g, st, true)));
            }
        }
        Some((stream::iter(out), (g, st, false)))
    })
    .flatten();
    let ping = ev("ping", json!({"type": "ping"}));
    Ok(sse(stream::iter(vec![start, ping]).chain(rest)))
}
