//! What the three chat-shaped APIs share: turning a conversation into prompt ids with DeepSeek
//! V4's own encoding, and turning the generated text back into reasoning, content and tool calls.

use crate::error::{ApiError, Flavor};
use crate::gen::{Finish, Gen, Piece, Usage};
use crate::openai::StartOpts;
use crate::params::Fields;
use crate::Shared;
use dsv4_chat::{encode_chat_spans, EncodeOptions, Message, OutputParser, Tool};
use dsv4_engine::TokenEvent;
use serde_json::Value;
use std::collections::VecDeque;

/// A conversation ready to encode.
pub struct Conversation {
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    pub thinking: bool,
    pub reasoning_effort: Option<String>,
    /// The JSON schema the answer must follow, shown to the model in the system header.
    pub response_format: Option<Value>,
}

/// Maps an OpenAI-style effort onto DeepSeek's: `none` turns thinking off, `max`/`xhigh` asks
/// for the maximal-effort preamble, the rest think at the default effort.
pub fn effort(flavor: Flavor, e: &str) -> Result<(bool, Option<String>), ApiError> {
    match e {
        "none" => Ok((false, None)),
        "minimal" | "low" | "medium" | "high" => Ok((true, None)),
        "max" | "xhigh" => Ok((true, Some("max".into()))),
        other => Err(ApiError::bad(flavor, format!("unknown reasoning effort `{other}`")).param("reasoning_effort")),
    }
}

/// Parses one function tool (`{name, description, parameters}`), rejecting bad schemas.
pub fn tool_from(
    flavor: Flavor,
    name: Option<&Value>,
    desc: Option<&Value>,
    params: Option<&Value>,
) -> Result<Tool, ApiError> {
    let name = match name {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        other => {
            return Err(ApiError::bad(
                flavor,
                format!("invalid tool: `name` must be a non-empty string, found {other:?}"),
            )
            .param("tools"))
        }
    };
    let description = match desc {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(other) => {
            return Err(ApiError::bad(
                flavor,
                format!("invalid tool `{name}`: description must be a string, found {other}"),
            )
            .param("tools"))
        }
    };
    let parameters = match params {
        None | Some(Value::Null) => Value::Null,
        Some(p @ Value::Object(_)) => {
            if let Some(t) = p.get("type") {
                if !t.is_string() && !t.is_array() {
                    return Err(ApiError::bad(
                        flavor,
                        format!("invalid tool `{name}`: schema `type` must be a string"),
                    )
                    .param("tools"));
                }
            }
            p.clone()
        }
        Some(other) => {
            return Err(ApiError::bad(
                flavor,
                format!("invalid tool `{name}`: the schema must be a JSON object, found {other}"),
            )
            .param("tools"))
        }
    };
    Ok(Tool { name, description, parameters })
}

/// Text of a content field: a string, null, or a list of text parts.
pub fn text_content(flavor: Flavor, v: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text" | "input_text" | "output_text"), Some(t)) => out.push_str(t),
                    (Some(t), _) => {
                        return Err(ApiError::bad(
                            flavor,
                            format!("`{field}`: content part type `{t}` is not supported (text only)"),
                        ))
                    }
                    _ => {
                        return Err(ApiError::bad(flavor, format!("`{field}`: content parts need a `type` and `text`")))
                    }
                }
            }
            Ok(out)
        }
        Some(other) => {
            Err(ApiError::bad(flavor, format!("`{field}` must be a string or a list of text parts, found {other}")))
        }
    }
}

/// The prompt ids of a conversation, with DeepSeek V4's encoding (BOS is in the text).
pub fn encode_prompt(s: &Shared, conv: &Conversation, flavor: Flavor) -> Result<Vec<u32>, ApiError> {
    let opts = EncodeOptions {
        thinking: conv.thinking,
        reasoning_effort: conv.reasoning_effort.clone(),
        response_format: conv.response_format.clone(),
        ..Default::default()
    };
    let (text, literal) = encode_chat_spans(&conv.messages, &conv.tools, &opts)
        .map_err(|e| ApiError::bad(flavor, e.to_string()).param("messages"))?;
    // User and tool content is plain text: special-token strings there stay text.
    s.guard.encode(text.len(), flavor, || s.tok.encode_with_literals(&text, &literal).map_err(|e| e.to_string()))
}

/// Encodes the conversation and starts generation.
pub fn start_chat(
    s: &Shared,
    conv: &Conversation,
    f: &Fields<'_>,
    o: &StartOpts,
    id: u64,
) -> Result<ChatGen, ApiError> {
    let prompt = encode_prompt(s, conv, f.flavor)?;
    // The prompt's last token opens or closes the thinking block of the new turn; the next turn
    // renders this turn's assistant message differently from there, so snapshot just before it.
    let o = StartOpts { snapshot_at: vec![prompt.len().saturating_sub(1)], ..o.clone() };
    let gen = crate::openai::start(s, prompt, f, &o, id)?;
    Ok(ChatGen { gen, parser: OutputParser::new(conv.thinking), queue: VecDeque::new(), tools: 0, done: false })
}

/// `n` generations of one conversation (the i-th seeded `seed + i`).
pub fn start_chats(
    s: &Shared,
    conv: &Conversation,
    f: &Fields<'_>,
    o: &StartOpts,
    id: u64,
    n: usize,
) -> Result<Vec<ChatGen>, ApiError> {
    (0..n).map(|i| start_chat(s, conv, f, &StartOpts { choice: i as u64, ..o.clone() }, id)).collect()
}

/// One step of a chat completion as the APIs stream it.
#[derive(Clone, Debug, PartialEq)]
pub enum ChatEvent {
    Reasoning(String),
    Content(String),
    ToolStart { index: usize, id: String, name: String },
    ToolArgs { index: usize, delta: String },
    ToolEnd { index: usize },
    Tokens(Vec<TokenEvent>),
    Done { finish: Finish, usage: Usage, tool_calls: usize },
    Error(String),
}

pub struct ChatGen {
    gen: Gen,
    parser: OutputParser,
    queue: VecDeque<ChatEvent>,
    tools: usize,
    done: bool,
}

impl ChatGen {
    /// (prompt tokens, cached tokens) once the engine admitted the sequence.
    pub fn prompt_usage(&self) -> (usize, usize) {
        self.gen.prompt_usage()
    }

    fn push_events(&mut self, evs: Vec<dsv4_chat::Event>) {
        for e in evs {
            self.queue.push_back(match e {
                dsv4_chat::Event::Reasoning(t) => ChatEvent::Reasoning(t),
                dsv4_chat::Event::Content(t) => ChatEvent::Content(t),
                dsv4_chat::Event::ToolCallStart { index, id, name } => {
                    self.tools = self.tools.max(index + 1);
                    ChatEvent::ToolStart { index, id, name }
                }
                dsv4_chat::Event::ToolCallArgs { index, delta } => ChatEvent::ToolArgs { index, delta },
                dsv4_chat::Event::ToolCallEnd { index } => ChatEvent::ToolEnd { index },
            });
        }
    }

    pub async fn next(&mut self) -> Option<ChatEvent> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            match self.gen.next().await? {
                Piece::Text(t, toks) => {
                    let evs = self.parser.push(&t);
                    self.push_events(evs);
                    if !toks.is_empty() {
                        self.queue.push_back(ChatEvent::Tokens(toks));
                    }
                }
                Piece::Done(finish, usage) => {
                    match self.parser.finish() {
                        Ok(evs) => self.push_events(evs),
                        // A completion cut short inside a tool call (max_tokens) is incomplete,
                        // not an error: what parsed so far stands.
                        Err(e) => tracing::warn!("unparsable completion tail: {e}"),
                    }
                    self.queue.push_back(ChatEvent::Done { finish, usage, tool_calls: self.tools });
                    self.done = true;
                }
                Piece::Error(e) => {
                    self.done = true;
                    return Some(ChatEvent::Error(e));
                }
            }
        }
    }

    /// Runs to the end and folds the events.
    pub async fn collect(mut self) -> Result<ChatResult, String> {
        let mut r = ChatResult::default();
        while let Some(e) = self.next().await {
            match e {
                ChatEvent::Reasoning(t) => r.reasoning.push_str(&t),
                ChatEvent::Content(t) => r.content.push_str(&t),
                ChatEvent::ToolStart { id, name, .. } => r.tool_calls.push((id, name, String::new())),
                ChatEvent::ToolArgs { index, delta } => {
                    if let Some(tc) = r.tool_calls.get_mut(index) {
                        tc.2.push_str(&delta);
                    }
                }
                ChatEvent::ToolEnd { .. } => {}
                ChatEvent::Tokens(t) => r.tokens.extend(t),
                ChatEvent::Done { finish, usage, .. } => {
                    r.finish = Some(finish);
                    r.usage = Some(usage);
                }
                ChatEvent::Error(e) => return Err(e),
            }
        }
        Ok(r)
    }
}

#[derive(Default)]
pub struct ChatResult {
    pub reasoning: String,
    pub content: String,
    /// (id, name, arguments JSON)
    pub tool_calls: Vec<(String, String, String)>,
    pub tokens: Vec<TokenEvent>,
    pub finish: Option<Finish>,
    pub usage: Option<Usage>,
}
