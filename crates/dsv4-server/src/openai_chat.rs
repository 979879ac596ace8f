//! `/v1/chat/completions` and `/v1/responses`.

use crate::chat::{
    effort, encode_prompt, start_chat, start_chats, text_content, tool_from, ChatEvent, ChatGen, Conversation,
};
use crate::error::{ApiError, Flavor};
use crate::gen::Finish;
use crate::gen::Usage;
use crate::openai::{add_usage, StartOpts};
use crate::openai::{chat_logprobs, data, next_id, server_error, sse};
use crate::params::Fields;
use crate::structured::{forced_tools, grammar_of, response_format, Shape};
use crate::{now_secs, Shared};
use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use dsv4_chat::{Message, Role, ToolCall};
use dsv4_engine::GrammarSpec;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

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

/// The answer's shape from `tool_choice` (forced calls) or else `response_format`.
pub fn chat_shape(
    fl: Flavor,
    tools: &[dsv4_chat::Tool],
    choice: Option<&Value>,
    format: Option<GrammarSpec>,
) -> Result<Shape, ApiError> {
    let forced = forced_tools(fl, choice, tools)?;
    Ok(if !forced.is_empty() {
        Shape::ToolCall(forced)
    } else if let Some(g) = format {
        Shape::Json(g)
    } else {
        Shape::Free
    })
}

/// What the encoder shows the model for a JSON-schema answer.
pub fn format_header(shape: &Shape) -> Option<Value> {
    match shape {
        Shape::Json(GrammarSpec::JsonSchema(s)) => Some(s.clone()),
        _ => None,
    }
}

pub async fn chat_inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    let model = s.check_model(&v, FL, false)?;
    let f = Fields::new(&v, FL);
    let n = crate::openai::n_choices(&f)?;
    let (thinking, reasoning_effort) = chat_thinking(&v)?;
    let tools = chat_tools(&v)?;
    let format = response_format(FL, v.get("response_format"), "response_format")?;
    let shape = chat_shape(FL, &tools, v.get("tool_choice"), format)?;
    let conv = Conversation {
        messages: chat_messages(&v)?,
        tools,
        thinking,
        reasoning_effort,
        response_format: format_header(&shape),
    };
    let max_tokens = match f.positive("max_completion_tokens")? {
        Some(n) => Some(n),
        None => f.positive("max_tokens")?,
    };
    let want_lp = f.bool("logprobs")?;
    let top = if want_lp { Some(f.u64("top_logprobs")?.unwrap_or(0).min(20) as usize) } else { None };
    let o = StartOpts {
        max_tokens,
        stop: f.strings("stop")?,
        top_logprobs: top,
        logits: crate::openai::logits_spec(&s, &f, grammar_of(&shape, s.tok.special.dsml), thinking)?,
        ..Default::default()
    };
    let mut o = o;
    if crate::structured::choice_is_none(v.get("tool_choice")) {
        crate::structured::ban_tool_calls(&mut o.logits, s.tok.special.dsml);
    }
    let stream = f.bool("stream")?;
    let include_usage = v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let idn = next_id();
    let gens = start_chats(&s, &conv, &f, &o, idn, n)?;
    let (id, created) = (format!("chatcmpl-{idn}"), now_secs());
    if !stream {
        let results = futures_util::future::join_all(gens.into_iter().map(ChatGen::collect)).await;
        let mut total = Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 };
        let mut choices = Vec::new();
        for (i, r) in results.into_iter().enumerate() {
            let r = r.map_err(|e| server_error(FL, e))?;
            let fin = r.finish.clone().unwrap_or(Finish::Stop);
            let usage = r.usage.clone().unwrap_or(Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 });
            add_usage(&mut total, &usage, i == 0);
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
            choices.push(json!({"index": i, "message": msg, "logprobs": lp, "finish_reason": finish_str(&fin, r.tool_calls.len())}));
        }
        return Ok(axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": crate::openai::usage_json(&total),
        }))
        .into_response());
    }
    let chunk = move |index: usize, delta: Value, fin: Value, lp: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": fin}]})
    };
    let total = Arc::new(Mutex::new(Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 }));
    let streams = gens
        .into_iter()
        .enumerate()
        .map(|(index, g)| {
            let first = data(&chunk(index, json!({"role": "assistant", "content": ""}), Value::Null, Value::Null));
            let (chunk, total, s) = (chunk.clone(), total.clone(), s.clone());
            let rest = stream::unfold((g, false), move |(mut g, ended)| {
                let (chunk, total, s) = (chunk.clone(), total.clone(), s.clone());
                async move {
                    if ended {
                        return None;
                    }
                    let c = |d: Value| data(&chunk(index, d, Value::Null, Value::Null));
                    let out: Vec<SseEvent> = match g.next().await? {
                        ChatEvent::Reasoning(t) => vec![c(json!({"reasoning_content": t}))],
                        ChatEvent::Content(t) => vec![c(json!({"content": t}))],
                        ChatEvent::ToolStart { index: ti, id, name } => vec![c(
                            json!({"tool_calls": [{"index": ti, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                        )],
                        ChatEvent::ToolArgs { index: ti, delta } => {
                            vec![c(json!({"tool_calls": [{"index": ti, "function": {"arguments": delta}}]}))]
                        }
                        ChatEvent::ToolEnd { .. } => vec![],
                        ChatEvent::Tokens(t) if want_lp => {
                            vec![data(&chunk(index, json!({}), Value::Null, chat_logprobs(&s, &t)))]
                        }
                        ChatEvent::Tokens(_) => vec![],
                        ChatEvent::Done { finish, usage, tool_calls } => {
                            add_usage(&mut total.lock().unwrap_or_else(|p| p.into_inner()), &usage, index == 0);
                            let v = vec![data(&chunk(index, json!({}), json!(finish_str(&finish, tool_calls)), Value::Null))];
                            return Some((stream::iter(v), (g, true)));
                        }
                        ChatEvent::Error(e) => {
                            return Some((stream::iter(vec![data(&server_error(FL, e).body())]), (g, true)));
                        }
                    };
                    Some((stream::iter(out), (g, false)))
                }
            })
            .flatten();
            stream::once(async move { first }).chain(rest).boxed()
        })
        .collect::<Vec<_>>();
    let tail = stream::once(async move {
        let mut v = Vec::new();
        if include_usage {
            let mut u = chunk(0, json!({}), Value::Null, Value::Null);
            u["choices"] = json!([]);
            u["usage"] = crate::openai::usage_json(&total.lock().unwrap_or_else(|p| p.into_inner()));
            v.push(data(&u));
        }
        v.push(SseEvent::default().data("[DONE]"));
        stream::iter(v)
    })
    .flatten();
    Ok(sse(stream::select_all(streams).chain(tail)))
}

/// Responses API `input` (a string or a list of items) and `instructions` as messages.
fn responses_messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let mut msgs = Vec::new();
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

/// Output items of a finished response, in order: reasoning, message, function calls.
fn response_items(
    idn: u64,
    thinking: bool,
    reasoning: &str,
    content: &str,
    calls: &[(String, String, String)],
) -> Vec<Value> {
    let mut output = Vec::new();
    if thinking && !reasoning.is_empty() {
        output.push(reasoning_item(idn, reasoning, "completed"));
    }
    if !content.is_empty() || (calls.is_empty() && output.is_empty()) {
        output.push(message_item(idn, content, "completed"));
    }
    for (i, (id, name, args)) in calls.iter().enumerate() {
        output.push(json!({"type": "function_call", "id": format!("fc_{idn}_{i}"), "call_id": id, "name": name,
                           "arguments": args, "status": "completed"}));
    }
    output
}

fn reasoning_item(idn: u64, text: &str, status: &str) -> Value {
    let summary = if text.is_empty() { json!([]) } else { json!([{"type": "summary_text", "text": text}]) };
    let content = if text.is_empty() { json!([]) } else { json!([{"type": "reasoning_text", "text": text}]) };
    json!({"type": "reasoning", "id": format!("rs_{idn}"), "status": status, "summary": summary, "content": content})
}

fn message_item(idn: u64, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    };
    json!({"type": "message", "id": format!("msg_{idn}"), "status": status, "role": "assistant", "content": content})
}

fn responses_usage(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "input_tokens_details": {"cached_tokens": u.cached_tokens},
           "output_tokens_details": {"reasoning_tokens": 0}})
}

/// The assistant turn a response adds to its conversation (for `previous_response_id`).
fn assistant_turn(reasoning: &str, content: &str, calls: &[(String, String, String)]) -> Message {
    let mut m = Message::assistant(content);
    if !reasoning.is_empty() {
        m.reasoning_content = Some(reasoning.to_string());
    }
    for (id, name, args) in calls {
        m.tool_calls.push(ToolCall { id: id.clone(), name: name.clone(), arguments: args.clone() });
    }
    m
}

pub async fn responses_inner(s: Shared, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let v = s.body(&headers, body, FL).await?;
    let model = s.check_model(&v, FL, false)?;
    let f = Fields::new(&v, FL);
    let (thinking, reasoning_effort) = match v.pointer("/reasoning/effort").and_then(Value::as_str) {
        Some(e) => effort(FL, e)?,
        None => (false, None),
    };
    let tools: Vec<dsv4_chat::Tool> = match v.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str).unwrap_or("function") == "function")
            .map(|t| tool_from(FL, t.get("name"), t.get("description"), t.get("parameters")))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(ApiError::bad(FL, format!("`tools` must be a list, found {other}")).param("tools")),
    };
    let choice = v.get("tool_choice");
    let none = choice.and_then(Value::as_str) == Some("none")
        || v.pointer("/tool_choice/type").and_then(Value::as_str) == Some("none");
    let tools = if none { Vec::new() } else { tools };
    let format = response_format(FL, v.pointer("/text/format"), "text.format")?;
    let shape = chat_shape(FL, &tools, choice, format)?;
    // The conversation: a stored one continued, then this input; instructions are not carried
    // over from the earlier response (as OpenAI does).
    let mut history = match f.str("previous_response_id")? {
        Some(id) => crate::store::previous(&s, id)?,
        None => Vec::new(),
    };
    history.extend(responses_messages(&v)?);
    let mut messages = Vec::new();
    if let Some(i) = v.get("instructions").filter(|x| !x.is_null()) {
        let i = i.as_str().ok_or_else(|| ApiError::bad(FL, "`instructions` must be a string").param("instructions"))?;
        messages.push(Message::system(i));
    }
    messages.extend(history.iter().cloned());
    let store = v.get("store").and_then(Value::as_bool).unwrap_or(true);
    let conv = Conversation { messages, tools, thinking, reasoning_effort, response_format: format_header(&shape) };
    let o = StartOpts {
        max_tokens: f.positive("max_output_tokens")?,
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
    let (rid, created) = (format!("resp_{idn}"), now_secs());
    let tool_choice = choice.cloned().unwrap_or(json!("auto"));
    let tools_echo = v.get("tools").cloned().unwrap_or(json!([]));
    let text_echo = v.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}}));
    let prev = v.get("previous_response_id").cloned().unwrap_or(Value::Null);
    let envelope = {
        let (rid, model) = (rid.clone(), model.clone());
        move |status: &str, output: Value, usage: Value| {
            let mut r = json!({"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                   "output": output, "usage": usage, "error": null, "incomplete_details": null,
                   "parallel_tool_calls": true, "tool_choice": tool_choice, "tools": tools_echo, "text": text_echo,
                   "previous_response_id": prev, "store": store});
            if status == "incomplete" {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            r
        }
    };
    let keep = move |s: &Shared, resp: &Value, turn: Message| {
        if store {
            let mut messages = history.clone();
            messages.push(turn);
            s.live.responses.put(
                resp["id"].as_str().unwrap_or("").to_string(),
                crate::store::Stored { messages, response: resp.clone() },
            );
        }
    };
    if !stream {
        let r = g.collect().await.map_err(|e| server_error(FL, e))?;
        let output = response_items(idn, thinking, &r.reasoning, &r.content, &r.tool_calls);
        let u = r.usage.unwrap_or(Usage { prompt_tokens: 0, completion_tokens: 0, cached_tokens: 0 });
        let status = if r.finish == Some(Finish::Length) { "incomplete" } else { "completed" };
        let resp = envelope(status, json!(output), responses_usage(&u));
        keep(&s, &resp, assistant_turn(&r.reasoning, &r.content, &r.tool_calls));
        return Ok(axum::Json(resp).into_response());
    }
    // Streaming, in OpenAI's order: each output item (reasoning, then the message, then
    // function calls) is added, filled by deltas and marked done before the next one opens.
    #[derive(PartialEq, Clone, Copy)]
    enum Open {
        None,
        Reasoning,
        Message,
        Call,
    }
    struct St {
        seq: u64,
        index: usize,
        open: Open,
        reasoning: String,
        text: String,
        calls: Vec<(String, String, String)>,
    }
    impl St {
        fn ev(&mut self, mut v: Value) -> SseEvent {
            v["sequence_number"] = json!(self.seq);
            self.seq += 1;
            data(&v)
        }
        fn close(&mut self, idn: u64, out: &mut Vec<SseEvent>) {
            let i = self.index;
            match self.open {
                Open::None => return,
                Open::Reasoning => {
                    let (id, t) = (format!("rs_{idn}"), self.reasoning.clone());
                    let part = json!({"type": "summary_text", "text": t});
                    let e = self.ev(json!({"type": "response.reasoning_summary_text.done", "item_id": id, "output_index": i, "summary_index": 0, "text": t}));
                    out.push(e);
                    let e = self.ev(json!({"type": "response.reasoning_summary_part.done", "item_id": id, "output_index": i, "summary_index": 0, "part": part}));
                    out.push(e);
                    let e = self.ev(json!({"type": "response.output_item.done", "output_index": i, "item": reasoning_item(idn, &t, "completed")}));
                    out.push(e);
                }
                Open::Message => {
                    let (id, t) = (format!("msg_{idn}"), self.text.clone());
                    let part = json!({"type": "output_text", "text": t, "annotations": [], "logprobs": []});
                    let e = self.ev(json!({"type": "response.output_text.done", "item_id": id, "output_index": i, "content_index": 0, "text": t, "logprobs": []}));
                    out.push(e);
                    let e = self.ev(json!({"type": "response.content_part.done", "item_id": id, "output_index": i, "content_index": 0, "part": part}));
                    out.push(e);
                    let e = self.ev(json!({"type": "response.output_item.done", "output_index": i, "item": message_item(idn, &t, "completed")}));
                    out.push(e);
                }
                Open::Call => {
                    let k = self.calls.len() - 1;
                    let (cid, name, args) = self.calls[k].clone();
                    let id = format!("fc_{idn}_{k}");
                    let e = self.ev(json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": i, "arguments": args}));
                    out.push(e);
                    let item = json!({"type": "function_call", "id": id, "call_id": cid, "name": name, "arguments": args, "status": "completed"});
                    let e = self.ev(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
                    out.push(e);
                }
            }
            self.open = Open::None;
            self.index += 1;
        }
        fn open(&mut self, idn: u64, want: Open, out: &mut Vec<SseEvent>) {
            if self.open == want && want != Open::Call {
                return;
            }
            self.close(idn, out);
            let i = self.index;
            match want {
                Open::Reasoning => {
                    let id = format!("rs_{idn}");
                    let item =
                        json!({"type": "reasoning", "id": id, "status": "in_progress", "summary": [], "content": []});
                    let e = self.ev(json!({"type": "response.output_item.added", "output_index": i, "item": item}));
                    out.push(e);
                    let e = self.ev(json!({"type": "response.reasoning_summary_part.added", "item_id": id, "output_index": i, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}));
                    out.push(e);
                }
                Open::Message => {
                    let id = format!("msg_{idn}");
                    let e = self.ev(json!({"type": "response.output_item.added", "output_index": i, "item": message_item(idn, "", "in_progress")}));
                    out.push(e);
                    let e = self.ev(json!({"type": "response.content_part.added", "item_id": id, "output_index": i, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
                    out.push(e);
                }
                Open::Call => {
                    let k = self.calls.len() - 1;
                    let (cid, name, _) = self.calls[k].clone();
                    let item = json!({"type": "function_call", "id": format!("fc_{idn}_{k}"), "call_id": cid, "name": name, "arguments": "", "status": "in_progress"});
                    let e = self.ev(json!({"type": "response.output_item.added", "output_index": i, "item": item}));
                    out.push(e);
                }
                Open::None => {}
            }
            self.open = want;
        }
    }
    let mut st =
        St { seq: 0, index: 0, open: Open::None, reasoning: String::new(), text: String::new(), calls: Vec::new() };
    let head = vec![
        st.ev(json!({"type": "response.created", "response": envelope("in_progress", json!([]), Value::Null)})),
        st.ev(json!({"type": "response.in_progress", "response": envelope("in_progress", json!([]), Value::Null)})),
    ];
    let state = (g, st, false, envelope, keep, s.clone());
    let rest = stream::unfold(state, move |(mut g, mut st, ended, envelope, keep, s)| async move {
        if ended {
            return None;
        }
        let e = g.next().await?;
        let mut out = Vec::new();
        match e {
            ChatEvent::Reasoning(t) => {
                st.open(idn, Open::Reasoning, &mut out);
                st.reasoning.push_str(&t);
                let (i, id) = (st.index, format!("rs_{idn}"));
                let e = st.ev(json!({"type": "response.reasoning_summary_text.delta", "item_id": id, "output_index": i, "summary_index": 0, "delta": t}));
                out.push(e);
            }
            ChatEvent::Content(t) => {
                st.open(idn, Open::Message, &mut out);
                st.text.push_str(&t);
                let (i, id) = (st.index, format!("msg_{idn}"));
                let e = st.ev(json!({"type": "response.output_text.delta", "item_id": id, "output_index": i, "content_index": 0, "delta": t, "logprobs": []}));
                out.push(e);
            }
            ChatEvent::ToolStart { id, name, .. } => {
                st.calls.push((id, name, String::new()));
                st.open(idn, Open::Call, &mut out);
            }
            ChatEvent::ToolArgs { index, delta } => {
                if let Some(c) = st.calls.get_mut(index) {
                    c.2.push_str(&delta);
                }
                let (i, id) = (st.index, format!("fc_{idn}_{index}"));
                let e = st.ev(json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": i, "delta": delta}));
                out.push(e);
            }
            ChatEvent::ToolEnd { .. } | ChatEvent::Tokens(_) => {}
            ChatEvent::Done { finish, usage, .. } => {
                if st.open == Open::None && st.index == 0 {
                    // Nothing at all was generated: one empty message, as the non-streaming reply.
                    st.open(idn, Open::Message, &mut out);
                }
                st.close(idn, &mut out);
                let output = response_items(idn, thinking, &st.reasoning, &st.text, &st.calls);
                let status = if finish == Finish::Length { "incomplete" } else { "completed" };
                let resp = envelope(status, json!(output), responses_usage(&usage));
                keep(&s, &resp, assistant_turn(&st.reasoning, &st.text, &st.calls));
                let kind = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
                let e = st.ev(json!({"type": kind, "response": resp}));
                out.push(e);
                return Some((stream::iter(out), (g, st, true, envelope, keep, s)));
            }
            ChatEvent::Error(e) => {
                let e = st.ev(json!({"type": "error", "code": "server_error", "message": e, "param": null}));
                out.push(e);
                return Some((stream::iter(out), (g, st, true, envelope, keep, s)));
            }
        }
        Some((stream::iter(out), (g, st, false, envelope, keep, s)))
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
        let conv = Conversation {
            messages: chat_messages(&v)?,
            tools: chat_tools(&v)?,
            thinking,
            reasoning_effort,
            response_format: None,
        };
        encode_prompt(&s, &conv, FL)?
    } else {
        let f = Fields::new(&v, FL);
        let p = f.str("prompt")?.ok_or_else(|| ApiError::bad(FL, "give `messages` or `prompt`"))?;
        crate::openai::encode_raw(&s, p, f.bool("parse_special_tokens")?, FL)?
    };
    Ok(axum::Json(json!({"count": tokens.len(), "tokens": tokens, "max_model_len": s.engine.config.max_context}))
        .into_response())
}
