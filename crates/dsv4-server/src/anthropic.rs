//! Anthropic Messages API (`/v1/messages`), with its streaming event sequence.

use crate::chat::{encode_prompt, start_chat, tool_from, ChatEvent, Conversation};
use crate::error::{ApiError, Flavor};
use crate::gen::{Finish, Usage};
use crate::openai::StartOpts;
use crate::openai::{next_id, server_error, sse};
use crate::params::Fields;
use crate::structured::{forced_tools, grammar_of, Shape};
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
            // Agents (Claude Code) put system reminders mid-conversation.
            "system" => out.push(Message::system(block_text(content, &field)?)),
            other => {
                return Err(bad(format!("`{field}.role` must be `user`, `assistant` or `system`, found `{other}`")))
            }
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

/// The conversation and answer shape of a Messages request (also what `count_tokens` counts).
fn conversation(v: &Value) -> Result<(Conversation, Shape), ApiError> {
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
            // Server tools (web search and friends) carry no schema: not ours to run.
            .filter(|t| {
                t.get("input_schema").is_some() || t.get("type").is_none() || t.get("type") == Some(&json!("custom"))
            })
            .map(|t| match t.get("input_schema") {
                Some(Value::Object(_)) => tool_from(FL, t.get("name"), t.get("description"), t.get("input_schema")),
                _ => Err(bad("every tool needs an `input_schema` object").param("tools")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("`tools` must be a list, found {other}")).param("tools")),
    };
    let tools = if v.pointer("/tool_choice/type").and_then(Value::as_str) == Some("none") { Vec::new() } else { tools };
    let forced = forced_tools(FL, v.get("tool_choice"), &tools)?;
    let shape = if forced.is_empty() { Shape::Free } else { Shape::ToolCall(forced) };
    Ok((
        Conversation { messages: convert_messages(v)?, tools, thinking, reasoning_effort: None, response_format: None },
        shape,
    ))
}

/// `POST /v1/messages/count_tokens`: the prompt tokens a Messages request would use.
pub async fn count_tokens(State(s): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let v = s.body(&headers, body, FL).await?;
        s.check_model(&v, FL, false)?;
        let (conv, _) = conversation(&v)?;
        let n = encode_prompt(&s, &conv, FL)?.len();
        Ok::<_, ApiError>(axum::Json(json!({"input_tokens": n})).into_response())
    };
    r.await.unwrap_or_else(|e| e.into_response())
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens), "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

async fn inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    let model = s.check_model(&v, FL, true)?;
    let f = Fields::new(&v, FL);
    let max_tokens = f.positive("max_tokens")?.ok_or_else(|| bad("`max_tokens` is required").param("max_tokens"))?;
    let (conv, shape) = conversation(&v)?;
    let thinking = conv.thinking;
    let o = StartOpts {
        max_tokens: Some(max_tokens),
        stop: f.strings("stop_sequences")?,
        logits: crate::openai::logits_spec(&s, &f, grammar_of(&shape, s.tok.special.dsml), thinking)?,
        ..Default::default()
    };
    let mut o = o;
    if crate::structured::choice_is_none(v.get("tool_choice")) {
        crate::structured::ban_tool_calls(&mut o.logits, s.tok.special.dsml);
    }
    let stream = f.bool("stream")?;
    let idn = next_id();
    let g = start_chat(&s, &conv, &f, &o, idn)?;
    let id = format!("msg_{idn}");
    if !stream {
        let r = g.collect().await.map_err(|e| server_error(FL, e))?;
        let mut content = Vec::new();
        if thinking && !r.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}));
        }
        if !r.content.is_empty() {
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
            "stop_reason": reason, "stop_sequence": seq, "usage": usage_json(&u),
        }))
        .into_response());
    }
    // `message_start` waits for the engine's first event, so its usage (prompt, cache read)
    // is the final one, as in the non-streaming reply.
    let start = move |g: &crate::chat::ChatGen| {
        let (prompt, cached) = g.prompt_usage();
        let u = Usage { prompt_tokens: prompt, completion_tokens: 0, cached_tokens: cached };
        let mut usage = usage_json(&u);
        usage["output_tokens"] = json!(1);
        SseEvent::default().event("message_start").data(
            json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": usage}})
            .to_string(),
        )
    };
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
    let state = (g, St { open: Open::None, index: 0 }, false, Some(start));
    let rest = stream::unfold(state, |(mut g, mut st, ended, mut start)| async move {
        if ended {
            return None;
        }
        let e = g.next().await?;
        let mut out = Vec::new();
        if let Some(start) = start.take() {
            out.push(start(&g));
            out.push(SseEvent::default().event("ping").data(json!({"type": "ping"}).to_string()));
        }
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
                close(&mut st, &mut out);
                let (reason, seq) = stop_reason(&finish, tool_calls);
                out.push(
                    SseEvent::default().event("message_delta").data(
                        json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": usage_json(&usage)})
                        .to_string(),
                    ),
                );
                out.push(SseEvent::default().event("message_stop").data(json!({"type": "message_stop"}).to_string()));
                return Some((stream::iter(out), (g, st, true, start)));
            }
            ChatEvent::Error(e) => {
                out.push(SseEvent::default().event("error").data(server_error(FL, e).body().to_string()));
                return Some((stream::iter(out), (g, st, true, start)));
            }
        }
        Some((stream::iter(out), (g, st, false, start)))
    })
    .flatten();
    Ok(sse(rest))
}
