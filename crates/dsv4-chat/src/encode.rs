//! Prompt rendering, following DeepSeek's `encoding_dsv4.encode_messages`.
//!
//! The pipeline mirrors the reference so that its quirks carry over exactly:
//! tool messages (and user messages right after them) are merged into one user
//! turn of `<tool_result>` blocks, results are reordered to the call order,
//! in thinking mode history before the last user turn loses its reasoning,
//! and every message is rendered with the transition token that depends on
//! the message after it.

use std::collections::HashMap;

use serde_json::Value;

use crate::tokens::{ASSISTANT, BOS, DSML, EOS, LATEST_REMINDER, THINK_END, THINK_START, USER};
use crate::{pyjson, ChatError, EncodeOptions, Message, ReasoningEffortProfile, Role, Task, Tool, ToolCall};

const EFFORT_PREVIEW_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, \
rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, \
and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

const EFFORT_OFFICIAL_MAX: &str = "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n\
You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the \
problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause \
rather than any surface symptom.\n\
Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that \
no assumption remains unchecked and no error remains undiscovered.\n\n";

/// The tools section of the system prompt; `{D}`, `{TS}`, `{TE}` and `{SCHEMAS}`
/// are filled in by [`render_tools`].
const TOOLS_TEMPLATE: &str = r#"## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D}tool_calls>" block like the following:

<{D}tool_calls>
<{D}invoke name="$TOOL_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$TOOL_NAME2">
...
</{D}invoke>
</{D}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {TS}), you MUST output your complete reasoning inside {TS}...{TE} BEFORE any tool calls or final response.

Otherwise, output directly after {TE} with tool calls or final response.

### Available Tool Schemas

{SCHEMAS}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"#;

const RESPONSE_FORMAT_HEADER: &str =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

/// JSON schema `type` names accepted in tool parameter schemas.
const SCHEMA_TYPES: [&str; 7] = ["string", "number", "integer", "boolean", "array", "object", "null"];

/// Renders `messages` (with `tools` offered in the system prompt) into the
/// prompt text DeepSeek's reference encoder produces for the same request.
///
/// `tools` go into the first message when it is a system message, otherwise
/// into an empty system message placed first, as SGLang's DeepSeek V4 serving
/// path does. The text begins with BOS when [`EncodeOptions::add_bos`] is set;
/// the V4 tokenizer must then be called without adding another one.
pub fn encode_chat(messages: &[Message], tools: &[Tool], opts: &EncodeOptions) -> Result<String, ChatError> {
    encode_chat_spans(messages, tools, opts).map(|(text, _)| text)
}

/// [`encode_chat`], plus the byte ranges of the text that hold user and tool content. Those are
/// to be tokenised as plain text (special-token strings there must not become control tokens,
/// or content could forge turns); the rest is the template's.
pub fn encode_chat_spans(
    messages: &[Message],
    tools: &[Tool],
    opts: &EncodeOptions,
) -> Result<(String, Vec<std::ops::Range<usize>>), ChatError> {
    validate(messages, tools, opts)?;
    let effort_preamble = effort_preamble(opts)?;

    let mut turns: Vec<Turn> = Vec::with_capacity(messages.len() + 1);
    let needs_header = !tools.is_empty() || opts.response_format.is_some();
    if needs_header && messages[0].role != Role::System {
        turns.push(Turn::empty_system());
    }
    turns.extend(messages.iter().enumerate().map(|(i, m)| Turn::from_message(i, m)));
    if needs_header {
        turns[0].header = true;
    }
    if let Some(task) = opts.task {
        let last = turns.iter_mut().rev().find(|t| matches!(t.role, Role::User | Role::Developer));
        last.ok_or(ChatError::TaskWithoutUser)?.task = Some(task);
    }
    if opts.continue_final_message {
        if let Some(last) = turns.last_mut() {
            last.wo_eos = true;
        }
    }

    let mut turns = merge_tool_messages(turns);
    sort_tool_results(&mut turns);
    // Like the reference, offering tools keeps all reasoning in the history.
    let drop_thinking = opts.drop_thinking && tools.is_empty();
    if opts.thinking && drop_thinking {
        turns = drop_old_thinking(turns);
    }

    let ctx = Ctx { opts, tools, drop_thinking, effort_preamble, literal: Default::default() };
    let mut prompt = String::new();
    if opts.add_bos {
        prompt.push_str(BOS);
    }
    let last_user = last_user_index(&turns);
    for i in 0..turns.len() {
        render_turn(&mut prompt, i, &turns, last_user, &ctx)?;
    }
    Ok((prompt, ctx.literal.into_inner()))
}

struct Ctx<'a> {
    opts: &'a EncodeOptions,
    tools: &'a [Tool],
    drop_thinking: bool,
    effort_preamble: &'static str,
    /// Byte ranges of user and tool content in the prompt.
    literal: std::cell::RefCell<Vec<std::ops::Range<usize>>>,
}

impl Ctx<'_> {
    /// Appends client content, recording where it lies.
    fn content(&self, out: &mut String, text: &str) {
        let start = out.len();
        out.push_str(text);
        if !text.is_empty() {
            self.literal.borrow_mut().push(start..out.len());
        }
    }
}

#[derive(Clone)]
enum Block<'a> {
    Text(&'a str),
    ToolResult { id: &'a str, content: &'a str },
}

/// A message in the reference encoder's internal (post-merge) form.
#[derive(Clone)]
struct Turn<'a> {
    role: Role,
    /// Index in the caller's messages, for error messages.
    index: Option<usize>,
    content: &'a str,
    /// User turns: text and tool-result blocks, joined by a blank line.
    blocks: Option<Vec<Block<'a>>>,
    reasoning: Option<&'a str>,
    tool_calls: &'a [ToolCall],
    tool_call_id: &'a str,
    task: Option<Task>,
    wo_eos: bool,
    /// Carries the tools and response format sections (the first system turn).
    header: bool,
}

impl<'a> Turn<'a> {
    fn empty_system() -> Turn<'a> {
        Turn {
            role: Role::System,
            index: None,
            content: "",
            blocks: None,
            reasoning: None,
            tool_calls: &[],
            tool_call_id: "",
            task: None,
            wo_eos: false,
            header: false,
        }
    }

    fn from_message(index: usize, m: &'a Message) -> Turn<'a> {
        Turn {
            role: m.role,
            index: Some(index),
            content: &m.content,
            reasoning: m.reasoning_content.as_deref(),
            tool_calls: &m.tool_calls,
            tool_call_id: m.tool_call_id.as_deref().unwrap_or(""),
            ..Turn::empty_system()
        }
    }
}

fn validate(messages: &[Message], tools: &[Tool], opts: &EncodeOptions) -> Result<(), ChatError> {
    if messages.is_empty() {
        return Err(ChatError::EmptyMessages);
    }
    let mut calls_in_scope: Option<&[ToolCall]> = None;
    for (index, m) in messages.iter().enumerate() {
        if m.role != Role::Assistant && !m.tool_calls.is_empty() {
            return Err(ChatError::UnexpectedToolCalls { index });
        }
        match m.role {
            Role::Assistant => {
                for (call, tc) in m.tool_calls.iter().enumerate() {
                    if tc.name.is_empty() {
                        let reason = "function.name must not be empty".to_string();
                        return Err(ChatError::InvalidToolCall { index, call, reason });
                    }
                    parse_arguments(&tc.arguments).map_err(|reason| ChatError::InvalidToolCall {
                        index,
                        call,
                        reason,
                    })?;
                }
                calls_in_scope = (!m.tool_calls.is_empty()).then_some(m.tool_calls.as_slice());
            }
            Role::Tool => {
                let calls = calls_in_scope.ok_or(ChatError::ToolWithoutCall { index })?;
                let id = m.tool_call_id.as_deref().unwrap_or("");
                let known_ids = calls.iter().any(|c| !c.id.is_empty());
                if !id.is_empty() && known_ids && !calls.iter().any(|c| c.id == id) {
                    return Err(ChatError::UnknownToolCallId { index, id: id.to_string() });
                }
            }
            _ => calls_in_scope = None,
        }
    }
    let mut names = std::collections::HashSet::new();
    for tool in tools {
        let invalid = |reason: &str| ChatError::InvalidTool { name: tool.name.clone(), reason: reason.to_string() };
        if tool.name.is_empty() {
            return Err(invalid("name must not be empty"));
        }
        if !names.insert(tool.name.as_str()) {
            return Err(invalid("defined more than once"));
        }
        match &tool.parameters {
            Value::Null => {}
            Value::Object(schema) => {
                if let Some(t) = schema.get("type") {
                    if t != "object" {
                        return Err(invalid("parameters must be a JSON schema of \"type\": \"object\""));
                    }
                }
                check_schema(&tool.parameters, "parameters").map_err(|r| invalid(&r))?;
            }
            _ => return Err(invalid("parameters must be a JSON object (a JSON schema)")),
        }
    }
    if opts.continue_final_message && messages.last().map(|m| m.role) != Some(Role::Assistant) {
        return Err(ChatError::NoFinalAssistant);
    }
    Ok(())
}

/// Checks every `type` in a JSON schema names a JSON schema type, so typos
/// are reported to the caller instead of confusing the model.
fn check_schema(schema: &Value, path: &str) -> Result<(), String> {
    let Value::Object(map) = schema else {
        // `true`/`false` are valid schemas; anything else is not.
        return if schema.is_boolean() { Ok(()) } else { Err(format!("{path} must be a JSON schema object")) };
    };
    if let Some(t) = map.get("type") {
        let ok = match t {
            Value::String(s) => SCHEMA_TYPES.contains(&s.as_str()),
            Value::Array(items) => {
                !items.is_empty() && items.iter().all(|i| i.as_str().is_some_and(|s| SCHEMA_TYPES.contains(&s)))
            }
            _ => false,
        };
        if !ok {
            return Err(format!("{path}.type: invalid JSON schema type {t}"));
        }
    }
    for key in ["properties", "$defs", "definitions", "patternProperties"] {
        if let Some(v) = map.get(key) {
            let Value::Object(props) = v else {
                return Err(format!("{path}.{key} must be an object"));
            };
            for (name, sub) in props {
                check_schema(sub, &format!("{path}.{key}.{name}"))?;
            }
        }
    }
    for key in ["items", "additionalProperties", "not", "contains", "if", "then", "else"] {
        match map.get(key) {
            Some(Value::Array(list)) if key == "items" => {
                for (i, sub) in list.iter().enumerate() {
                    check_schema(sub, &format!("{path}.{key}[{i}]"))?;
                }
            }
            Some(sub) => check_schema(sub, &format!("{path}.{key}"))?,
            None => {}
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(v) = map.get(key) {
            let Value::Array(list) = v else {
                return Err(format!("{path}.{key} must be an array"));
            };
            for (i, sub) in list.iter().enumerate() {
                check_schema(sub, &format!("{path}.{key}[{i}]"))?;
            }
        }
    }
    Ok(())
}

/// Parses tool-call arguments; the reference requires a JSON object.
fn parse_arguments(text: &str) -> Result<serde_json::Map<String, Value>, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("function.arguments must be a JSON object".into()),
        Err(e) => Err(format!("function.arguments is not valid JSON: {e}")),
    }
}

fn effort_preamble(opts: &EncodeOptions) -> Result<&'static str, ChatError> {
    let table: &[(&str, &'static str)] = match opts.reasoning_effort_profile {
        ReasoningEffortProfile::Preview => &[("high", ""), ("max", EFFORT_PREVIEW_MAX)],
        ReasoningEffortProfile::Official => &[("low", ""), ("high", EFFORT_PREVIEW_MAX), ("max", EFFORT_OFFICIAL_MAX)],
    };
    let effort = opts.reasoning_effort.as_deref().unwrap_or(table[0].0);
    table.iter().find(|(name, _)| *name == effort).map(|(_, text)| *text).ok_or_else(|| {
        ChatError::InvalidReasoningEffort {
            effort: effort.to_string(),
            profile: opts.reasoning_effort_profile.as_str().to_string(),
            expected: table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        }
    })
}

/// Folds tool messages into user turns of `<tool_result>` blocks. A user
/// message right after tool results joins that same turn (so do consecutive
/// user messages), unless the turn carries a task.
fn merge_tool_messages(turns: Vec<Turn<'_>>) -> Vec<Turn<'_>> {
    let mut merged: Vec<Turn> = Vec::with_capacity(turns.len());
    for t in turns {
        let open_user = merged.last_mut().filter(|last| last.role == Role::User && last.blocks.is_some());
        match t.role {
            Role::Tool => {
                let block = Block::ToolResult { id: t.tool_call_id, content: t.content };
                match open_user {
                    Some(last) => last.blocks.get_or_insert_with(Vec::new).push(block),
                    None => merged.push(Turn { role: Role::User, blocks: Some(vec![block]), ..t }),
                }
            }
            Role::User => {
                let block = Block::Text(t.content);
                match open_user.filter(|last| last.task.is_none()) {
                    Some(last) => last.blocks.get_or_insert_with(Vec::new).push(block),
                    None => merged.push(Turn { blocks: Some(vec![block]), ..t }),
                }
            }
            _ => merged.push(t),
        }
    }
    merged
}

/// Reorders the tool results inside each user turn to the order of the calls
/// of the most recent assistant turn with tool calls (stable; unknown ids sort
/// as position 0).
fn sort_tool_results(turns: &mut [Turn<'_>]) {
    let mut order: HashMap<&str, usize> = HashMap::new();
    for t in turns.iter_mut() {
        if t.role == Role::Assistant && !t.tool_calls.is_empty() {
            order.clear();
            for (i, tc) in t.tool_calls.iter().enumerate() {
                if !tc.id.is_empty() {
                    order.insert(tc.id.as_str(), i);
                }
            }
        } else if t.role == Role::User {
            let Some(blocks) = t.blocks.as_mut() else { continue };
            let slots: Vec<usize> =
                (0..blocks.len()).filter(|&i| matches!(blocks[i], Block::ToolResult { .. })).collect();
            if slots.len() < 2 || order.is_empty() {
                continue;
            }
            let mut results: Vec<Block> = slots.iter().map(|&i| blocks[i].clone()).collect();
            results.sort_by_key(|b| match b {
                Block::ToolResult { id, .. } => order.get(id).copied().unwrap_or(0),
                Block::Text(_) => 0,
            });
            for (slot, block) in slots.into_iter().zip(results) {
                blocks[slot] = block;
            }
        }
    }
}

/// Index of the last user or developer turn.
fn last_user_index(turns: &[Turn<'_>]) -> Option<usize> {
    turns.iter().rposition(|t| matches!(t.role, Role::User | Role::Developer))
}

/// Before the last user turn: assistant turns lose their reasoning and
/// developer turns are removed.
fn drop_old_thinking(turns: Vec<Turn<'_>>) -> Vec<Turn<'_>> {
    let last_user = last_user_index(&turns).unwrap_or(0);
    let mut out = Vec::with_capacity(turns.len());
    for (i, mut t) in turns.into_iter().enumerate() {
        if i >= last_user || matches!(t.role, Role::User | Role::System | Role::LatestReminder | Role::Tool) {
            out.push(t);
        } else if t.role == Role::Assistant {
            t.reasoning = None;
            out.push(t);
        }
    }
    out
}

fn render_tools(out: &mut String, tools: &[Tool]) {
    let mut schemas = String::new();
    for (i, tool) in tools.iter().enumerate() {
        if i > 0 {
            schemas.push('\n');
        }
        schemas.push_str("{\"name\": ");
        pyjson::write_str(&mut schemas, &tool.name);
        if let Some(desc) = &tool.description {
            schemas.push_str(", \"description\": ");
            pyjson::write_str(&mut schemas, desc);
        }
        if !tool.parameters.is_null() {
            schemas.push_str(", \"parameters\": ");
            schemas.push_str(&pyjson::dumps(&tool.parameters));
        }
        schemas.push('}');
    }
    // Schemas are spliced in verbatim, so tool text containing `{D}` stays as is.
    let fill = |part: &str| part.replace("{D}", DSML).replace("{TS}", THINK_START).replace("{TE}", THINK_END);
    let (head, tail) = TOOLS_TEMPLATE.split_once("{SCHEMAS}").expect("template has {SCHEMAS}");
    out.push_str(&fill(head));
    out.push_str(&schemas);
    out.push_str(&fill(tail));
}

fn render_tool_calls(out: &mut String, calls: &[ToolCall]) {
    out.push_str("\n\n<");
    out.push_str(DSML);
    out.push_str("tool_calls>\n");
    for (i, tc) in calls.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&format!("<{DSML}invoke name=\"{}\">\n", tc.name));
        // Validated before rendering.
        let args = parse_arguments(&tc.arguments).unwrap_or_default();
        for (j, (key, value)) in args.iter().enumerate() {
            if j > 0 {
                out.push('\n');
            }
            let (is_str, text) = match value {
                Value::String(s) => ("true", s.clone()),
                other => ("false", pyjson::dumps(other)),
            };
            out.push_str(&format!("<{DSML}parameter name=\"{key}\" string=\"{is_str}\">{text}</{DSML}parameter>"));
        }
        out.push_str(&format!("\n</{DSML}invoke>"));
    }
    out.push_str(&format!("\n</{DSML}tool_calls>"));
}

fn render_turn(
    out: &mut String,
    i: usize,
    turns: &[Turn<'_>],
    last_user: Option<usize>,
    ctx: &Ctx<'_>,
) -> Result<(), ChatError> {
    let t = &turns[i];
    let thinking = ctx.opts.thinking;
    // `index > last_user_idx` in the reference, where "none" is -1.
    let after_last_user = |i: usize| match last_user {
        Some(u) => i > u,
        None => true,
    };
    if i == 0 && thinking {
        out.push_str(ctx.effort_preamble);
    }
    match t.role {
        Role::System | Role::Developer => {
            if t.role == Role::Developer {
                if t.content.is_empty() {
                    return Err(ChatError::EmptyDeveloperMessage { index: t.index.unwrap_or(i) });
                }
                out.push_str(USER);
            }
            out.push_str(t.content);
            if t.header {
                if !ctx.tools.is_empty() {
                    out.push_str("\n\n");
                    render_tools(out, ctx.tools);
                }
                if let Some(rf) = &ctx.opts.response_format {
                    out.push_str("\n\n");
                    out.push_str(RESPONSE_FORMAT_HEADER);
                    out.push_str(&pyjson::dumps(rf));
                }
            }
        }
        Role::User | Role::Tool => {
            out.push_str(USER);
            match &t.blocks {
                Some(blocks) if !blocks.is_empty() => {
                    for (j, b) in blocks.iter().enumerate() {
                        if j > 0 {
                            out.push_str("\n\n");
                        }
                        match b {
                            Block::Text(text) => ctx.content(out, text),
                            Block::ToolResult { content, .. } => {
                                out.push_str("<tool_result>");
                                ctx.content(out, content);
                                out.push_str("</tool_result>");
                            }
                        }
                    }
                }
                _ => ctx.content(out, t.content),
            }
        }
        Role::LatestReminder => {
            out.push_str(LATEST_REMINDER);
            out.push_str(t.content);
        }
        Role::Assistant => {
            let prev_has_task = i > 0 && turns[i - 1].task.is_some();
            if thinking && !prev_has_task && (!ctx.drop_thinking || after_last_user(i)) {
                out.push_str(t.reasoning.unwrap_or(""));
                out.push_str(THINK_END);
            }
            out.push_str(t.content);
            if !t.tool_calls.is_empty() {
                render_tool_calls(out, t.tool_calls);
            }
            if !t.wo_eos {
                out.push_str(EOS);
            }
        }
    }

    // The transition after a turn depends on what follows it: nothing unless
    // the next turn is the assistant's (or a latest_reminder), or this is the
    // end and a generation prompt is wanted.
    let next = match turns.get(i + 1) {
        Some(next) => Some(next.role),
        None if ctx.opts.add_generation_prompt => None,
        None => Some(Role::System),
    };
    if next.is_some_and(|r| r != Role::Assistant && r != Role::LatestReminder) {
        return Ok(());
    }
    if let Some(task) = t.task {
        if task == Task::Action {
            out.push_str(ASSISTANT);
            out.push_str(if thinking { THINK_START } else { THINK_END });
        }
        out.push_str(task.token());
    } else if matches!(t.role, Role::User | Role::Developer) {
        out.push_str(ASSISTANT);
        let at_or_after_last_user = match last_user {
            Some(u) => i >= u,
            None => true,
        };
        let open_think = thinking && (!ctx.drop_thinking || at_or_after_last_user);
        out.push_str(if open_think { THINK_START } else { THINK_END });
    }
    Ok(())
}
