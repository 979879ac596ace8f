//! DeepSeek V4 chat encoding.
//!
//! DeepSeek V4 ships no Jinja chat template; its prompt format is defined by a
//! Python reference encoder (`encoding_dsv4.py`, see this crate's README). This
//! crate re-implements it so that the server renders byte-identical prompts:
//!
//! * [`encode_chat`] turns OpenAI-style messages and tools into prompt text,
//!   special tokens included as strings. The text starts with
//!   `<｜begin▁of▁sentence｜>` (unless [`EncodeOptions::add_bos`] is off), so
//!   tokenize it with `dsv4_tokenizer::Tokenizer::encode(&text, false)`; the V4
//!   tokenizer never adds BOS itself.
//! * [`parse_output`] and the streaming [`OutputParser`] split a completion into
//!   reasoning, content and DSML tool calls.
//!
//! ```
//! use dsv4_chat::{encode_chat, EncodeOptions, Message};
//! let prompt = encode_chat(&[Message::user("Hi")], &[], &EncodeOptions::default()).unwrap();
//! assert_eq!(prompt, "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>");
//! ```

mod encode;
mod parse;
pub mod pyjson;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use encode::{encode_chat, encode_chat_spans};
pub use parse::{parse_output, Event, OutputParser, ParsedOutput};

/// The special-token strings the encoder writes into prompt text.
pub mod tokens {
    /// Starts every conversation (written by the encoder, not the tokenizer).
    pub const BOS: &str = "<｜begin▁of▁sentence｜>";
    /// Ends every finished assistant turn.
    pub const EOS: &str = "<｜end▁of▁sentence｜>";
    /// Opens a user (and developer) turn.
    pub const USER: &str = "<｜User｜>";
    /// Opens an assistant turn.
    pub const ASSISTANT: &str = "<｜Assistant｜>";
    /// Opens a `latest_reminder` turn.
    pub const LATEST_REMINDER: &str = "<｜latest_reminder｜>";
    /// Starts the reasoning block (thinking mode generation prompt).
    pub const THINK_START: &str = "<think>";
    /// Ends the reasoning block; alone, it is the non-thinking generation prompt.
    pub const THINK_END: &str = "</think>";
    /// The marker inside every DSML tool-call tag.
    pub const DSML: &str = "｜DSML｜";
}

/// Errors for input the encoder rejects and for malformed model output.
///
/// Encoding errors are caused by the request, so a server maps them to HTTP 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    #[error("messages must not be empty")]
    EmptyMessages,
    #[error("unknown role `{0}` (expected system, user, assistant, tool, developer or latest_reminder)")]
    UnknownRole(String),
    #[error("message {index}: a developer message must have non-empty content")]
    EmptyDeveloperMessage { index: usize },
    #[error("message {index}: a tool message must follow an assistant message with tool_calls")]
    ToolWithoutCall { index: usize },
    #[error("message {index}: tool_call_id `{id}` does not match any tool call of the preceding assistant message")]
    UnknownToolCallId { index: usize, id: String },
    #[error("message {index}: only assistant messages may have tool_calls")]
    UnexpectedToolCalls { index: usize },
    #[error("message {index}: tool call {call}: {reason}")]
    InvalidToolCall { index: usize, call: usize, reason: String },
    #[error("tool `{name}`: {reason}")]
    InvalidTool { name: String, reason: String },
    #[error("invalid reasoning_effort `{effort}` for profile `{profile}` (expected one of {expected})")]
    InvalidReasoningEffort { effort: String, profile: String, expected: String },
    #[error("unknown reasoning effort profile `{0}` (expected preview or official)")]
    UnknownReasoningEffortProfile(String),
    #[error("unknown task `{0}` (expected action, query, authority, domain, title or read_url)")]
    UnknownTask(String),
    #[error("a task requires at least one user or developer message")]
    TaskWithoutUser,
    #[error("continue_final_message requires the last message to be an assistant message")]
    NoFinalAssistant,
    #[error("malformed model output: {0}")]
    MalformedOutput(String),
}

/// A message author, as in the OpenAI chat API plus DeepSeek's own roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool result; the encoder folds it into a user turn as `<tool_result>`.
    Tool,
    /// Rendered like a user turn; dropped from history in thinking mode.
    Developer,
    /// DeepSeek's `<｜latest_reminder｜>` turn.
    LatestReminder,
}

impl Role {
    /// The role's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Developer => "developer",
            Role::LatestReminder => "latest_reminder",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = ChatError;

    /// Parses a wire role name, so a server can answer unknown roles with a 400.
    fn from_str(s: &str) -> Result<Role, ChatError> {
        Ok(match s {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            "developer" => Role::Developer,
            "latest_reminder" => Role::LatestReminder,
            other => return Err(ChatError::UnknownRole(other.to_string())),
        })
    }
}

/// One chat message (OpenAI shape, flattened to text content).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default)]
    pub content: String,
    /// Reasoning of an earlier assistant turn; kept or dropped per [`EncodeOptions::drop_thinking`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For tool messages: orders results by the preceding assistant's call order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Accepted for API compatibility; the encoder does not render it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with only a role and text content.
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
            reasoning_content: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Message {
        Message::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Message {
        Message::new(Role::User, content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new(Role::Assistant, content)
    }

    /// A tool result answering the call `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Message {
        Message { tool_call_id: Some(tool_call_id.into()), ..Message::new(Role::Tool, content) }
    }
}

/// A function call made by the assistant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default)]
    pub id: String,
    pub name: String,
    /// JSON text of an object, as in the OpenAI API.
    pub arguments: String,
}

/// A function tool the model may call (the `function` part of an OpenAI tool).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of the arguments; `Null` means "not given" and is not rendered.
    #[serde(default)]
    pub parameters: serde_json::Value,
}

/// Which table maps `reasoning_effort` to a system preamble.
///
/// The reference encoder has both: checkpoints released as "preview" accept
/// `high` (default, no preamble) and `max`; "official" ones accept `low`
/// (default, no preamble), `high` and `max`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffortProfile {
    #[default]
    Preview,
    Official,
}

impl ReasoningEffortProfile {
    /// The profile's name in the reference encoder.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffortProfile::Preview => "preview",
            ReasoningEffortProfile::Official => "official",
        }
    }
}

impl FromStr for ReasoningEffortProfile {
    type Err = ChatError;

    fn from_str(s: &str) -> Result<Self, ChatError> {
        match s {
            "preview" => Ok(ReasoningEffortProfile::Preview),
            "official" => Ok(ReasoningEffortProfile::Official),
            other => Err(ChatError::UnknownReasoningEffortProfile(other.to_string())),
        }
    }
}

/// DeepSeek's internal quick-instruction tasks, rendered as a special token
/// after the last user turn instead of (or after) the generation prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    Action,
    Query,
    Authority,
    Domain,
    Title,
    ReadUrl,
}

impl Task {
    /// The task's special token.
    pub fn token(self) -> &'static str {
        match self {
            Task::Action => "<｜action｜>",
            Task::Query => "<｜query｜>",
            Task::Authority => "<｜authority｜>",
            Task::Domain => "<｜domain｜>",
            Task::Title => "<｜title｜>",
            Task::ReadUrl => "<｜read_url｜>",
        }
    }
}

impl FromStr for Task {
    type Err = ChatError;

    fn from_str(s: &str) -> Result<Task, ChatError> {
        Ok(match s {
            "action" => Task::Action,
            "query" => Task::Query,
            "authority" => Task::Authority,
            "domain" => Task::Domain,
            "title" => Task::Title,
            "read_url" => Task::ReadUrl,
            other => return Err(ChatError::UnknownTask(other.to_string())),
        })
    }
}

/// Options of the reference encoder (`encode_messages`), named after it.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodeOptions {
    /// `thinking_mode == "thinking"`: the generation prompt opens `<think>`.
    pub thinking: bool,
    /// `reasoning_effort`: `None` is the profile's default (no preamble).
    pub reasoning_effort: Option<String>,
    /// `reasoning_effort_profile`.
    pub reasoning_effort_profile: ReasoningEffortProfile,
    /// `drop_thinking`: in thinking mode, drop reasoning of turns before the last
    /// user message (and developer messages there). Ignored when tools are given.
    pub drop_thinking: bool,
    /// `add_default_bos_token`: start the text with BOS.
    pub add_bos: bool,
    /// Append `<｜Assistant｜>` + `<think>`/`</think>` after a final user turn.
    /// The reference encoder always does; `false` renders the messages as if
    /// another non-assistant message followed (no transition, no task token).
    pub add_generation_prompt: bool,
    /// Leave the final assistant message open (no EOS) so the model continues
    /// it; the reference encoder's per-message `wo_eos`.
    pub continue_final_message: bool,
    /// Appended to the system prompt as a "## Response Format" section.
    pub response_format: Option<serde_json::Value>,
    /// A quick-instruction task attached to the last user/developer message.
    pub task: Option<Task>,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            thinking: false,
            reasoning_effort: None,
            reasoning_effort_profile: ReasoningEffortProfile::Preview,
            drop_thinking: true,
            add_bos: true,
            add_generation_prompt: true,
            continue_final_message: false,
            response_format: None,
            task: None,
        }
    }
}
