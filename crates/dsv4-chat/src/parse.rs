//! Splitting a completion into reasoning, content and DSML tool calls.
//!
//! Follows DeepSeek's `parse_message_from_completion_text`: in thinking mode the
//! completion is `reasoning</think>content`, then optionally
//! `\n\n<｜DSML｜tool_calls>…</｜DSML｜tool_calls>`, then EOS. The one-shot
//! [`parse_output`] is the streaming [`OutputParser`] fed everything at once, so
//! both always agree.
//!
//! Differences from the reference, all at the end of the text: EOS may be
//! missing (engines usually strip it), and a completion cut off inside the
//! reasoning or the content (e.g. by `max_tokens`) is accepted as is. A cut-off
//! tool-call block is still an error.

use crate::tokens::{BOS, EOS, THINK_END, THINK_START};
use crate::{ChatError, Message, Role, ToolCall};

const DSML: &str = crate::tokens::DSML;
const TOOL_CALLS_START: &str = "\n\n<｜DSML｜tool_calls";
const TOOL_CALLS_END: &str = "</｜DSML｜tool_calls>";
const INVOKE: &str = "<｜DSML｜invoke";
const INVOKE_END: &str = "</｜DSML｜invoke";
const PARAM: &str = "<｜DSML｜parameter";
const PARAM_END: &str = "/｜DSML｜parameter";
/// `<` + [`PARAM_END`]: the normal end of a parameter value.
const PARAM_END_LT: &str = "</｜DSML｜parameter";
/// The reference's `<$` also matches before a final newline.
const PARAM_END_LT_NL: &str = "<\n/｜DSML｜parameter";
const PARAM_NAME_PREFIX: &str = " name=\"";
const PARAM_STRING_TRUE: &str = "\" string=\"true\">";
const PARAM_STRING_FALSE: &str = "\" string=\"false\">";
/// What separates DSML tags.
const GAP: &str = ">\n";

/// One step of a parsed completion; concatenating them gives the [`ParsedOutput`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Reasoning(String),
    Content(String),
    /// A tool call begins; its name is complete.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of the call's arguments, as JSON text.
    ToolCallArgs {
        index: usize,
        delta: String,
    },
    ToolCallEnd {
        index: usize,
    },
}

/// A parsed assistant completion.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// Empty in non-thinking mode.
    pub reasoning_content: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedOutput {
    /// Folds one event in, as a client of the stream would.
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Reasoning(s) => self.reasoning_content.push_str(s),
            Event::Content(s) => self.content.push_str(s),
            Event::ToolCallStart { id, name, .. } => {
                self.tool_calls.push(ToolCall { id: id.clone(), name: name.clone(), arguments: String::new() })
            }
            Event::ToolCallArgs { index, delta } => {
                if let Some(tc) = self.tool_calls.get_mut(*index) {
                    tc.arguments.push_str(delta);
                }
            }
            Event::ToolCallEnd { .. } => {}
        }
    }

    /// Folds a sequence of events.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a Event>) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        for e in events {
            out.apply(e);
        }
        out
    }

    /// The assistant message to append to the conversation for the next turn.
    pub fn into_message(self, thinking: bool) -> Message {
        Message {
            reasoning_content: thinking.then_some(self.reasoning_content),
            tool_calls: self.tool_calls,
            ..Message::new(Role::Assistant, self.content)
        }
    }
}

/// Parses a whole completion (the text generated after the prompt).
///
/// `thinking` must match the prompt's mode: in thinking mode the prompt ended
/// with `<think>`, so the completion starts with reasoning.
pub fn parse_output(text: &str, thinking: bool) -> Result<ParsedOutput, ChatError> {
    let mut parser = OutputParser::new(thinking);
    let mut events = parser.push(text);
    events.extend(parser.finish()?);
    Ok(ParsedOutput::from_events(&events))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    /// Between DSML tags of the block: `>\n` then an invoke or the block end.
    BlockGap,
    /// After `<｜DSML｜invoke`: ` name="…">\n` up to the first parameter or the invoke end.
    InvokeHeader,
    /// After `<｜DSML｜parameter`: ` name="…" string="true|false">`.
    ParamHeader,
    ParamValue {
        string: bool,
    },
    /// Between parameters: `>\n` then another parameter or the invoke end.
    ParamGap,
    /// After the block: only EOS may follow.
    AfterBlock,
    /// After EOS: nothing may follow.
    Done,
    Failed,
}

/// Incremental completion parser for streaming responses.
///
/// Text that could still turn out to be markup (a partial `</think>`, the
/// start of a DSML block, EOS) is held back until decided, so DSML never
/// reaches [`Event::Content`]. Tool calls get deterministic ids
/// `<prefix><n>` (default prefix `call_`), as DSML carries none.
#[derive(Debug, Clone)]
pub struct OutputParser {
    state: State,
    buf: String,
    id_prefix: String,
    /// Tool calls started so far; the current one has index `calls - 1`.
    calls: usize,
    params: Vec<String>,
    error: Option<ChatError>,
}

/// Outcome of looking for the state's markers in the buffer.
enum Scan {
    /// Marker `which` starts at byte `at`, and no earlier marker can still appear.
    Found { at: usize, which: usize },
    /// No decision yet; `buf[..safe]` can never be part of a marker.
    Wait { safe: usize },
}

fn scan(buf: &str, markers: &[&str], eof: bool) -> Scan {
    let mut found: Option<(usize, usize)> = None;
    for (which, m) in markers.iter().enumerate() {
        if let Some(at) = buf.find(m) {
            let earlier = match found {
                Some((best, _)) => at < best,
                None => true,
            };
            if earlier {
                found = Some((at, which));
            }
        }
    }
    let partial = if eof {
        None
    } else {
        let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
        (buf.len().saturating_sub(longest)..buf.len())
            .filter(|&q| buf.is_char_boundary(q))
            .find(|&q| markers.iter().any(|m| m.len() > buf.len() - q && m.starts_with(&buf[q..])))
    };
    match (found, partial) {
        (Some((at, _)), Some(q)) if q < at => Scan::Wait { safe: q },
        (Some((at, which)), _) => Scan::Found { at, which },
        (None, Some(q)) => Scan::Wait { safe: q },
        (None, None) => Scan::Wait { safe: buf.len() },
    }
}

/// Python's `str.isspace`, which the reference's `\s` uses.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The tool name in an invoke header (the reference's `^\s*name="(.*?)">\n$`).
fn invoke_name(header: &str) -> Option<&str> {
    let rest = header.trim_start_matches(is_py_space).strip_prefix("name=\"")?;
    // `$` also matches before one final newline.
    rest.strip_suffix("\">\n\n").or_else(|| rest.strip_suffix("\">\n"))
}

/// Whether `buf` can still grow into `>\n` followed by one of `markers`.
fn gap_possible(buf: &str, markers: &[&str]) -> bool {
    if buf.len() <= GAP.len() {
        return GAP.starts_with(buf);
    }
    buf.starts_with(GAP) && markers.iter().any(|m| m.starts_with(&buf[GAP.len()..]))
}

impl OutputParser {
    /// A parser for a completion of a prompt in thinking (`<think>`) or chat mode.
    pub fn new(thinking: bool) -> OutputParser {
        OutputParser::with_id_prefix(thinking, "call_")
    }

    /// Like [`OutputParser::new`], naming tool calls `<id_prefix><n>`, so a
    /// server can make ids unique across responses.
    pub fn with_id_prefix(thinking: bool, id_prefix: impl Into<String>) -> OutputParser {
        OutputParser {
            state: if thinking { State::Reasoning } else { State::Content },
            buf: String::new(),
            id_prefix: id_prefix.into(),
            calls: 0,
            params: Vec::new(),
            error: None,
        }
    }

    /// Feeds more completion text; returns the events it decides.
    ///
    /// Malformed output stops the parser: later calls return nothing and
    /// [`OutputParser::finish`] reports the error.
    pub fn push(&mut self, text: &str) -> Vec<Event> {
        let mut events = Vec::new();
        if self.state == State::Failed {
            return events;
        }
        self.buf.push_str(text);
        self.run(false, &mut events);
        events
    }

    /// Ends the completion: flushes held-back text and reports malformed output.
    pub fn finish(&mut self) -> Result<Vec<Event>, ChatError> {
        let mut events = Vec::new();
        if self.state != State::Failed {
            self.run(true, &mut events);
        }
        if let Some(err) = self.error.take() {
            self.state = State::Failed;
            self.error = Some(err.clone());
            return Err(err);
        }
        Ok(events)
    }

    fn run(&mut self, eof: bool, events: &mut Vec<Event>) {
        loop {
            match self.step(eof, events) {
                Ok(true) => {}
                Ok(false) => break,
                Err(msg) => {
                    self.state = State::Failed;
                    self.buf.clear();
                    self.error = Some(ChatError::MalformedOutput(msg));
                    break;
                }
            }
        }
    }

    fn emit(events: &mut Vec<Event>, event: Event) {
        let merged = match (events.last_mut(), &event) {
            (Some(Event::Reasoning(a)), Event::Reasoning(b)) | (Some(Event::Content(a)), Event::Content(b)) => {
                a.push_str(b);
                true
            }
            (Some(Event::ToolCallArgs { index: i, delta: a }), Event::ToolCallArgs { index: j, delta: b })
                if i == j =>
            {
                a.push_str(b);
                true
            }
            _ => false,
        };
        if !merged {
            events.push(event);
        }
    }

    fn emit_text(&self, events: &mut Vec<Event>, text: &str) {
        if text.is_empty() {
            return;
        }
        let event = match self.state {
            State::Reasoning => Event::Reasoning(text.to_string()),
            _ => Event::Content(text.to_string()),
        };
        Self::emit(events, event);
    }

    fn emit_args(&self, events: &mut Vec<Event>, delta: String) {
        if !delta.is_empty() {
            Self::emit(events, Event::ToolCallArgs { index: self.calls - 1, delta });
        }
    }

    fn emit_value(&self, events: &mut Vec<Event>, text: &str, string: bool) {
        if string {
            let mut escaped = String::with_capacity(text.len());
            crate::pyjson::write_str_body(&mut escaped, text);
            self.emit_args(events, escaped);
        } else {
            self.emit_args(events, text.to_string());
        }
    }

    /// Consumes what the buffer decides; `Ok(false)` means more input is needed.
    fn step(&mut self, eof: bool, events: &mut Vec<Event>) -> Result<bool, String> {
        match self.state {
            State::Reasoning | State::Content => {
                let reasoning = self.state == State::Reasoning;
                // The first markers change state; the rest must not appear at all.
                let markers: &[&str] = if reasoning {
                    &[THINK_END, TOOL_CALLS_START, BOS, EOS, THINK_START, DSML]
                } else {
                    &[EOS, TOOL_CALLS_START, BOS, THINK_START, THINK_END, DSML]
                };
                match scan(&self.buf, markers, eof) {
                    Scan::Wait { safe } => {
                        let text: String = self.buf.drain(..safe).collect();
                        self.emit_text(events, &text);
                        Ok(false)
                    }
                    Scan::Found { at, which } => {
                        let marker = markers[which];
                        if reasoning && which == 1 {
                            return Err("tool calls before the end of reasoning (missing </think>)".into());
                        }
                        if which > 1 {
                            let place = if reasoning { "reasoning" } else { "content" };
                            return Err(format!("unexpected special token `{marker}` in {place}"));
                        }
                        let text: String = self.buf.drain(..at).collect();
                        self.emit_text(events, &text);
                        self.buf.drain(..marker.len());
                        self.state = match (reasoning, which) {
                            (true, _) => State::Content,
                            (false, 0) => State::Done,
                            _ => State::BlockGap,
                        };
                        Ok(true)
                    }
                }
            }
            State::BlockGap | State::ParamGap => {
                let block = self.state == State::BlockGap;
                let markers: &[&str] = if block { &[INVOKE, TOOL_CALLS_END] } else { &[PARAM, INVOKE_END] };
                match scan(&self.buf, markers, eof) {
                    Scan::Wait { .. } => {
                        if eof {
                            Err("tool call block is incomplete".into())
                        } else if gap_possible(&self.buf, markers) {
                            Ok(false)
                        } else {
                            Err(format!("expected `>\\n` between DSML tags, got {:?}", self.buf))
                        }
                    }
                    Scan::Found { at, which } => {
                        if &self.buf[..at] != GAP {
                            return Err(format!("expected `>\\n` between DSML tags, got {:?}", &self.buf[..at]));
                        }
                        self.buf.drain(..at + markers[which].len());
                        self.state = match (block, which) {
                            (true, 0) => State::InvokeHeader,
                            (true, _) => State::AfterBlock,
                            (false, 0) => State::ParamHeader,
                            (false, _) => {
                                self.end_invoke(events);
                                State::BlockGap
                            }
                        };
                        Ok(true)
                    }
                }
            }
            State::InvokeHeader => match scan(&self.buf, &[PARAM, INVOKE_END], eof) {
                Scan::Wait { .. } if eof => Err("tool call block is incomplete".into()),
                Scan::Wait { .. } => Ok(false),
                Scan::Found { at, which } => {
                    let header = &self.buf[..at];
                    let name = invoke_name(header).ok_or_else(|| format!("malformed tool call header {header:?}"))?;
                    let index = self.calls;
                    let event =
                        Event::ToolCallStart { index, id: format!("{}{index}", self.id_prefix), name: name.into() };
                    Self::emit(events, event);
                    self.calls += 1;
                    self.params.clear();
                    self.buf.drain(..at + [PARAM, INVOKE_END][which].len());
                    if which == 0 {
                        self.state = State::ParamHeader;
                    } else {
                        self.end_invoke(events);
                        self.state = State::BlockGap;
                    }
                    Ok(true)
                }
            },
            State::ParamHeader => {
                let n = PARAM_NAME_PREFIX.len();
                if self.buf.len() < n {
                    return match PARAM_NAME_PREFIX.starts_with(self.buf.as_str()) {
                        true if eof => Err("tool call block is incomplete".into()),
                        true => Ok(false),
                        false => Err(format!("malformed parameter header {:?}", self.buf)),
                    };
                }
                if !self.buf.starts_with(PARAM_NAME_PREFIX) {
                    return Err(format!("malformed parameter header {:?}", self.buf));
                }
                let markers = [PARAM_STRING_TRUE, PARAM_STRING_FALSE, PARAM_END];
                match scan(&self.buf[n..], &markers, eof) {
                    Scan::Wait { .. } if eof => Err("tool call block is incomplete".into()),
                    Scan::Wait { .. } => Ok(false),
                    Scan::Found { which: 2, .. } => Err(format!("malformed parameter header {:?}", self.buf)),
                    Scan::Found { at, which } => {
                        let name = self.buf[n..n + at].to_string();
                        if self.params.contains(&name) {
                            return Err(format!("duplicate parameter name {name:?}"));
                        }
                        let string = which == 0;
                        let mut prefix = String::from(if self.params.is_empty() { "{" } else { ", " });
                        crate::pyjson::write_str(&mut prefix, &name);
                        prefix.push_str(": ");
                        if string {
                            prefix.push('"');
                        }
                        self.emit_args(events, prefix);
                        self.params.push(name);
                        self.buf.drain(..n + at + markers[which].len());
                        self.state = State::ParamValue { string };
                        Ok(true)
                    }
                }
            }
            State::ParamValue { string } => {
                let markers = [PARAM_END_LT, PARAM_END_LT_NL, PARAM_END];
                match scan(&self.buf, &markers, eof) {
                    Scan::Wait { .. } if eof => Err("tool call block is incomplete".into()),
                    Scan::Wait { safe } => {
                        let text: String = self.buf.drain(..safe).collect();
                        self.emit_value(events, &text, string);
                        Ok(false)
                    }
                    Scan::Found { which: 2, .. } => Err("parameter value does not end with `<`".into()),
                    Scan::Found { at, which } => {
                        let text: String = self.buf.drain(..at).collect();
                        self.emit_value(events, &text, string);
                        if string {
                            self.emit_args(events, "\"".into());
                        }
                        self.buf.drain(..markers[which].len());
                        self.state = State::ParamGap;
                        Ok(true)
                    }
                }
            }
            State::AfterBlock => match scan(&self.buf, &[EOS], eof) {
                Scan::Found { at: 0, .. } => {
                    self.buf.drain(..EOS.len());
                    self.state = State::Done;
                    Ok(true)
                }
                Scan::Wait { .. } if !eof && EOS.starts_with(self.buf.as_str()) => Ok(false),
                Scan::Wait { .. } if self.buf.is_empty() => Ok(false),
                _ => Err(format!("unexpected text after tool calls: {:?}", self.buf)),
            },
            State::Done if self.buf.is_empty() => Ok(false),
            State::Done => Err(format!("unexpected text after end of sentence: {:?}", self.buf)),
            State::Failed => Ok(false),
        }
    }

    fn end_invoke(&mut self, events: &mut Vec<Event>) {
        let close = if self.params.is_empty() { "{}" } else { "}" };
        self.emit_args(events, close.into());
        Self::emit(events, Event::ToolCallEnd { index: self.calls - 1 });
    }
}
