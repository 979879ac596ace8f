//! `/v1/chat/completions` and `/v1/responses`.

use crate::chat::{effort, encode_prompt, start_chat, text_content, tool_from, ChatEvent, Conversation};
use crate::error::{ApiError, Flavor};
use crate::gen::Finish;
use crate::openai::{chat_logprobs, data, next_id, server_error, sse};
use crate::params::Fields;
use crate::{now_secs, Shared};
use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use dsv4_chat::{Message, Role, ToolCall};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

const FL: Flavor = Flavor::OpenAi;

fn chat_messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let arr = match v.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::bad(FL, "`messages` must not be empty").param("messages")),
        Some(other) => {
            return Err(ApiError::bad(FL, format!("`messages` must be a list, found {other}")).param("messages"))
        }
        None => return Err(ApiError::bad(FL, "`messages` is required").param("messages")),
    };
    arr.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = format!("messages[{i}]");
            let role: Role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(FL, format!("`{field}.role` is required")).param("messages"))?
                .parse()
                .map_err(|e: dsv4_chat::ChatError| ApiError::bad(FL, format!("`{field}`: {e}")).param("messages"))?;
            let mut msg = Message::new(role, text_content(FL, m.get("content"), &field)?);
            if let Some(r) = m.get("reasoning_content").and_then(Value::as_str) {
                msg.reasoning_content = Some(r.to_string());
            }
            if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
                msg.tool_call_id = Some(id.to_string());
            }
            if let Some(Value::Array(tcs)) = m.get("tool_calls") {
                for tc in tcs {
                    let func = tc.get("function").unwrap_or(&Value::Null);
                    let name = func.get("name").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::bad(FL, format!("`{field}.tool_calls[].function.name` is required")).param("messages")
                    })?;
                    let arguments = match func.get("arguments") {
                        Some(Value::String(s)) => s.clone(),
                        Some(o @ Value::Object(_)) => o.to_string(),
                        None | Some(Value::Null) => "{}".into(),
                        Some(other) => {
                            return Err(ApiError::bad(
                                FL,
                                format!("`{field}`: tool call arguments must be a JSON string, found {other}"),
                            ))
                        }
                    };
                    let id = tc.get("id").and_then(Value::as_str).unwrap_or("").to_string();
                    msg.tool_calls.push(ToolCall { id, name: name.to_string(), arguments });
                }
            }
            Ok(msg)
        })
        .collect()
}

fn chat_tools(v: &Value) -> Result<Vec<dsv4_chat::Tool>, ApiError> {
    if v.get("tool_choice").and_then(Value::as_str) == Some("none") {
        return Ok(Vec::new());
    }
    match v.get("tools") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                let f = t.get("function").unwrap_or(t);
                tool_from(FL, f.get("name"), f.get("description"), f.get("parameters"))
            })
            .collect(),
        Some(other) => Err(ApiError::bad(FL, format!("`tools` must be a list, found {other}")).param("tools")),
    }
}

/// Thinking from `chat_template_kwargs.thinking`/`enable_thinking` or `reasoning_effort`.
fn chat_thinking(v: &Value) -> Result<(bool, Option<String>), ApiError> {
    let kw = v.get("chat_template_kwargs");
    let explicit = kw.and_then(|k| k.get("thinking").or_else(|| k.get("enable_thinking"))).and_then(Value::as_bool);
    let (mut thinking, mut eff) = (false, None);
    if let Some(e) = v.get("reasoning_effort").filter(|x| !x.is_null()) {
        let e = e
            .as_str()
            .ok_or_else(|| ApiError::bad(FL, "`reasoning_effort` must be a string").param("reasoning_effort"))?;
        (thinking, eff) = effort(FL, e)?;
    }
    if let Some(t) = explicit {
        thinking = t;
    }
    Ok((thinking, eff))
}

fn finish_str(f: &Finish, tools: usize) -> &'static str {
    match f {
        Finish::Length => "length",
        _ if tools > 0 => "tool_calls",
        _ => "stop",
    }
}

pub async fn chat_inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    s.check_model(&v, FL, false)?;
    let f = Fields::new(&v, FL);
    if let Some(n) = f.u64("n")? {
        if n != 1 {
            return Err(ApiError::bad(FL, format!("n = {n} is not supported; use n = 1")).param("n"));
        }
    }
    let (thinking, reasoning_effort) = chat_thinking(&v)?;
    let conv = Conversation { messages: chat_messages(&v)?, tools: chat_tools(&v)?, thinking, reasoning_effort };
    let max_tokens = match f.positive("max_completion_tokens")? {
        Some(n) => n,
        None => f.positive("max_tokens")?.unwrap_or(s.default_max_tokens),
    };
    let stop = f.strings("stop")?;
    let want_lp = f.bool("logprobs")?;
    let top = if want_lp { Some(f.u64("top_logprobs")?.unwrap_or(0).min(20) as usize) } else { None };
    let stream = f.bool("stream")?;
    let include_usage = v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let idn = next_id();
    // Keep the requested cap within the context the engine allows.
    let g = start_chat(&s, &conv, &f, max_tokens, stop, top, idn)?;
    let (id, model, created) = (format!("chatcmpl-{idn}"), s.model_name.clone(), now_secs());
    if !stream {
        let r = g.collect().await.map_err(|e| server_error(FL, e))?;
        let fin = r.finish.unwrap_or(Finish::Stop);
        let usage = r.usage.unwrap_or(crate::gen::Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 });
        let mut msg = json!({"role": "assistant", "content": r.content});
        if thinking {
            msg["reasoning_content"] = json!(r.reasoning);
        }
        if !r.tool_calls.is_empty() {
            msg["tool_calls"] = json!(r
                .tool_calls
                .iter()
                .map(|(id, name, args)| json!({
                "id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect::<Vec<_>>());
        }
        let lp = if want_lp { chat_logprobs(&s, &r.tokens) } else { Value::Null };
        return Ok(axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish_str(&fin, r.tool_calls.len())}],
            "usage": crate::openai::usage_json(&usage),
        }))
        .into_response());
    }
    let chunk = move |delta: Value, fin: Value, lp: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": fin}]})
    };
    let first = data(&chunk(json!({"role": "assistant", "content": ""}), Value::Null, Value::Null));
    let st = (g, false, s.clone());
    let rest = stream::unfold(st, move |(mut g, ended, s)| {
        let chunk = chunk.clone();
        async move {
            if ended {
                return None;
            }
            let ev = g.next().await?;
            let out: Vec<SseEvent> = match ev {
                ChatEvent::Reasoning(t) => vec![data(&chunk(json!({"reasoning_content": t}), Value::Null, Value::Null))],
                ChatEvent::Content(t) => vec![data(&chunk(json!({"content": t}), Value::Null, Value::Null))],
                ChatEvent::ToolStart { index, id, name } => vec![data(&chunk(
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                    Value::Null,
                    Value::Null,
                ))],
                ChatEvent::ToolArgs { index, delta } => vec![data(&chunk(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
                    Value::Null,
                    Value::Null,
                ))],
                ChatEvent::ToolEnd { .. } => vec![],
                ChatEvent::Tokens(t) if want_lp => vec![data(&chunk(json!({}), Value::Null, chat_logprobs(&s, &t)))],
                ChatEvent::Tokens(_) => vec![],
                ChatEvent::Done { finish, usage, tool_calls } => {
                    let mut v = vec![data(&chunk(json!({}), json!(finish_str(&finish, tool_calls)), Value::Null))];
                    if include_usage {
                        let mut u = chunk(json!({}), Value::Null, Value::Null);
                        u["choices"] = json!([]);
                        u["usage"] = crate::openai::usage_json(&usage);
                        v.push(data(&u));
                    }
                    v.push(SseEvent::default().data("[DONE]"));
                    return Some((stream::iter(v), (g, true, s)));
                }
                ChatEvent::Error(e) => {
                    let v = vec![data(&server_error(FL, e).body()), SseEvent::default().data("[DONE]")];
                    return Some((stream::iter(v), (g, true, s)));
                }
            };
            Some((stream::iter(out), (g, false, s)))
        }
    })
    .flatten();
    Ok(sse(stream::once(async move { first }).chain(rest)))
}

/// Responses API `input` (a string or a list of items) and `instructions` as messages.
fn responses_messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let mut msgs = Vec::new();
    if let Some(i) = v.get("instructions").filter(|x| !x.is_null()) {
        let i = i.as_str().ok_or_else(|| ApiError::bad(FL, "`instructions` must be a string").param("instructions"))?;
        msgs.push(Message::system(i));
    }
    match v.get("input") {
        Some(Value::String(t)) => msgs.push(Message::user(t.clone())),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, it) in items.iter().enumerate() {
                let field = format!("input[{i}]");
                let ty = it.get("type").and_then(Value::as_str).unwrap_or(if it.get("role").is_some() {
                    "message"
                } else {
                    ""
                });
                match ty {
                    "message" => {
                        let role: Role = it.get("role").and_then(Value::as_str).unwrap_or("").parse().map_err(
                            |e: dsv4_chat::ChatError| ApiError::bad(FL, format!("`{field}`: {e}")).param("input"),
                        )?;
                        msgs.push(Message::new(role, text_content(FL, it.get("content"), &field)?));
                    }
                    "function_call" => {
                        let call = ToolCall {
                            id: it.get("call_id").and_then(Value::as_str).unwrap_or("").to_string(),
                            name: it
                                .get("name")
                                .and_then(Value::as_str)
                                .ok_or_else(|| ApiError::bad(FL, format!("`{field}.name` is required")))?
                                .to_string(),
                            arguments: it.get("arguments").and_then(Value::as_str).unwrap_or("{}").to_string(),
                        };
                        match msgs.last_mut() {
                            Some(m) if m.role == Role::Assistant => m.tool_calls.push(call),
                            _ => {
                                let mut m = Message::assistant("");
                                m.tool_calls.push(call);
                                msgs.push(m);
                            }
                        }
                    }
                    "function_call_output" => {
                        let id = it.get("call_id").and_then(Value::as_str).unwrap_or("");
                        let out = match it.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        };
                        msgs.push(Message::tool(id, out));
                    }
                    "reasoning" => {} // earlier reasoning is dropped from history, as the encoder does
                    other => {
                        return Err(ApiError::bad(FL, format!("`{field}`: item type `{other}` is not supported"))
                            .param("input"))
                    }
                }
            }
        }
        Some(Value::Array(_)) => return Err(ApiError::bad(FL, "`input` must not be empty").param("input")),
        Some(other) => {
            return Err(
                ApiError::bad(FL, format!("`input` must be a string or a list of items, found {other}")).param("input")
            )
        }
        None => return Err(ApiError::bad(FL, "`input` is required").param("input")),
    }
    Ok(msgs)
}

pub async fn responses_inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    s.check_model(&v, FL, false)?;
    let f = Fields::new(&v, FL);
    let (thinking, reasoning_effort) = match v.pointer("/reasoning/effort").and_then(Value::as_str) {
        Some(e) => effort(FL, e)?,
        None => (false, None),
    };
    let tools = match v.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str).unwrap_or("function") == "function")
            .map(|t| tool_from(FL, t.get("name"), t.get("description"), t.get("parameters")))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(ApiError::bad(FL, format!("`tools` must be a list, found {other}")).param("tools")),
    };
    let conv = Conversation { messages: responses_messages(&v)?, tools, thinking, reasoning_effort };
    let max_tokens = f.positive("max_output_tokens")?.unwrap_or(s.default_max_tokens);
    let stream = f.bool("stream")?;
    let idn = next_id();
    let g = start_chat(&s, &conv, &f, max_tokens, Vec::new(), None, idn)?;
    let (rid, model, created) = (format!("resp_{idn}"), s.model_name.clone(), now_secs());
    let msg_id = format!("msg_{idn}");
    let envelope = {
        let (rid, model) = (rid.clone(), model.clone());
        move |status: &str, output: Value, usage: Value| {
            json!({"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                   "output": output, "usage": usage, "error": null, "incomplete_details": null,
                   "parallel_tool_calls": true, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}})
        }
    };
    if !stream {
        let r = g.collect().await.map_err(|e| server_error(FL, e))?;
        let mut output = Vec::new();
        if thinking {
            output.push(json!({"type": "reasoning", "id": format!("rs_{idn}"), "summary": [{"type": "summary_text", "text": r.reasoning}]}));
        }
        if !r.content.is_empty() || r.tool_calls.is_empty() {
            output.push(json!({"type": "message", "id": msg_id, "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": r.content, "annotations": []}]}));
        }
        for (i, (id, name, args)) in r.tool_calls.iter().enumerate() {
            output.push(json!({"type": "function_call", "id": format!("fc_{idn}_{i}"), "call_id": id, "name": name,
                               "arguments": args, "status": "completed"}));
        }
        let u = r.usage.unwrap_or(crate::gen::Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 });
        let status = if r.finish == Some(Finish::Length) { "incomplete" } else { "completed" };
        let mut resp = envelope(
            status,
            json!(output),
            json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens}}),
        );
        if status == "incomplete" {
            resp["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        return Ok(axum::Json(resp).into_response());
    }
    // Streaming: one message item (output 0) for text; reasoning is folded into it as
    // `response.reasoning_text.delta`; function calls follow as their own items.
    let mut seq = 0u64;
    let mut ev = move |v: Value| {
        let mut v = v;
        v["sequence_number"] = json!(seq);
        seq += 1;
        data(&v)
    };
    let created_ev =
        ev(json!({"type": "response.created", "response": envelope("in_progress", json!([]), Value::Null)}));
    let item = json!({"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []});
    let added = ev(json!({"type": "response.output_item.added", "output_index": 0, "item": item}));
    let part =
        ev(json!({"type": "response.content_part.added", "item_id": msg_id, "output_index": 0, "content_index": 0,
                         "part": {"type": "output_text", "text": "", "annotations": []}}));
    struct St {
        text: String,
        calls: Vec<(String, String, String)>,
    }
    let head = vec![created_ev, added, part];
    let state = (g, St { text: String::new(), calls: Vec::new() }, false, ev, envelope, msg_id, idn);
    let rest = stream::unfold(state, |(mut g, mut st, ended, mut ev, envelope, msg_id, idn)| async move {
        if ended {
            return None;
        }
        let e = g.next().await?;
        let out: Vec<SseEvent> = match e {
            ChatEvent::Content(t) => {
                st.text.push_str(&t);
                vec![ev(json!({"type": "response.output_text.delta", "item_id": msg_id, "output_index": 0, "content_index": 0, "delta": t, "logprobs": []}))]
            }
            ChatEvent::Reasoning(t) => vec![ev(json!({"type": "response.reasoning_text.delta", "item_id": msg_id, "output_index": 0, "content_index": 0, "delta": t}))],
            ChatEvent::ToolStart { id, name, .. } => {
                st.calls.push((id, name, String::new()));
                vec![]
            }
            ChatEvent::ToolArgs { index, delta } => {
                if let Some(c) = st.calls.get_mut(index) {
                    c.2.push_str(&delta);
                }
                vec![]
            }
            ChatEvent::ToolEnd { .. } | ChatEvent::Tokens(_) => vec![],
            ChatEvent::Done { finish, usage, .. } => {
                let text_part = json!({"type": "output_text", "text": st.text, "annotations": []});
                let msg = json!({"type": "message", "id": msg_id, "status": "completed", "role": "assistant", "content": [text_part]});
                let mut v = vec![
                    ev(json!({"type": "response.output_text.done", "item_id": msg_id, "output_index": 0, "content_index": 0, "text": st.text, "logprobs": []})),
                    ev(json!({"type": "response.content_part.done", "item_id": msg_id, "output_index": 0, "content_index": 0, "part": text_part})),
                    ev(json!({"type": "response.output_item.done", "output_index": 0, "item": msg})),
                ];
                let mut output = vec![msg];
                for (i, (id, name, args)) in st.calls.iter().enumerate() {
                    let item = json!({"type": "function_call", "id": format!("fc_{idn}_{i}"), "call_id": id, "name": name, "arguments": args, "status": "completed"});
                    v.push(ev(json!({"type": "response.output_item.added", "output_index": i + 1, "item": item})));
                    v.push(ev(json!({"type": "response.function_call_arguments.done", "item_id": format!("fc_{idn}_{i}"), "output_index": i + 1, "arguments": args})));
                    v.push(ev(json!({"type": "response.output_item.done", "output_index": i + 1, "item": item})));
                    output.push(item);
                }
                let status = if finish == Finish::Length { "incomplete" } else { "completed" };
                let mut resp = envelope(status, json!(output), json!({"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                    "total_tokens": usage.prompt_tokens + usage.completion_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens}}));
                if status == "incomplete" {
                    resp["incomplete_details"] = json!({"reason": "max_output_tokens"});
                }
                let kind = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
                v.push(ev(json!({"type": kind, "response": resp})));
                return Some((stream::iter(v), (g, st, true, ev, envelope, msg_id, idn)));
            }
            ChatEvent::Error(e) => {
                let v = vec![ev(json!({"type": "error", "code": "server_error", "message": e, "param": null}))];
                return Some((stream::iter(v), (g, st, true, ev, envelope, msg_id, idn)));
            }
        };
        Some((stream::iter(out), (g, st, false, ev, envelope, msg_id, idn)))
    })
    .flatten();
    Ok(sse(stream::iter(head).chain(rest)))
}

/// `POST /tokenize`: the prompt ids the server would run for a chat request (`messages`, with
/// the same tools and thinking options) or a raw `prompt`; lets clients and tests count tokens.
pub async fn tokenize_inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    let tokens = if v.get("messages").is_some() {
        let (thinking, reasoning_effort) = chat_thinking(&v)?;
        let conv = Conversation { messages: chat_messages(&v)?, tools: chat_tools(&v)?, thinking, reasoning_effort };
        encode_prompt(&s, &conv, FL)?
    } else {
        let f = Fields::new(&v, FL);
        let p = f.str("prompt")?.ok_or_else(|| ApiError::bad(FL, "give `messages` or `prompt`"))?;
        crate::openai::encode_raw(&s, p, f.bool("parse_special_tokens")?, FL)?
    };
    Ok(axum::Json(json!({"count": tokens.len(), "tokens": tokens, "max_model_len": s.engine.config.max_context}))
        .into_response())
}
