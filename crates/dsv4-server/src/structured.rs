//! Structured outputs: `response_format` / `text.format` (JSON object, JSON schema) and forced
//! tool calls (`tool_choice` required/named, Anthropic any/tool) turned into grammars for the
//! engine's constraint (`dsv4_engine::constraint`). A forced call is a DSML block, the format
//! the model was trained on, whose parameter values are JSON matching the tool's schema.

use crate::error::{ApiError, Flavor};
use dsv4_chat::tokens::DSML;
use dsv4_chat::Tool;
use dsv4_engine::GrammarSpec;
use serde_json::Value;

/// What the answer must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    Free,
    Json(GrammarSpec),
    /// One DSML tool call to one of these tools.
    ToolCall(Vec<Tool>),
}

/// OpenAI chat `response_format`.
pub fn response_format(flavor: Flavor, v: Option<&Value>, field: &str) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(rf) = v.filter(|x| !x.is_null()) else { return Ok(None) };
    let bad = |m: String| ApiError::bad(flavor, m).param(field);
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            // Chat nests it under `json_schema`; Responses' `text.format` has it inline.
            let holder = rf.get("json_schema").unwrap_or(rf);
            match holder.get("schema") {
                Some(s @ Value::Object(_)) => Ok(Some(GrammarSpec::JsonSchema(s.clone()))),
                Some(Value::Bool(true)) | None => Ok(Some(GrammarSpec::JsonObject)),
                Some(other) => Err(bad(format!("`{field}`: the schema must be a JSON object, found {other}"))),
            }
        }
        Some(t) => Err(bad(format!("`{field}.type` must be text, json_object or json_schema, found `{t}`"))),
        None => Err(bad(format!("`{field}` needs a `type`"))),
    }
}

/// Which tools a `tool_choice` forces (empty: none forced). `none` is handled by the caller
/// (the tools are not shown, so no call can be emitted).
pub fn forced_tools(flavor: Flavor, choice: Option<&Value>, tools: &[Tool]) -> Result<Vec<Tool>, ApiError> {
    let bad = |m: String| ApiError::bad(flavor, m).param("tool_choice");
    let named = |name: &str| -> Result<Vec<Tool>, ApiError> {
        tools
            .iter()
            .find(|t| t.name == name)
            .map(|t| vec![t.clone()])
            .ok_or_else(|| bad(format!("`tool_choice` names `{name}`, which is not among the tools")))
    };
    let all = || -> Result<Vec<Tool>, ApiError> {
        if tools.is_empty() {
            Err(bad("`tool_choice` requires a tool call but no tools were given".into()))
        } else {
            Ok(tools.to_vec())
        }
    };
    match choice {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => match s.as_str() {
            "auto" | "none" => Ok(Vec::new()),
            "required" | "any" => all(),
            other => Err(bad(format!("unknown `tool_choice` `{other}`"))),
        },
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("auto" | "none") => Ok(Vec::new()),
            Some("any" | "required") => all(),
            // Anthropic {"type": "tool", "name"}; OpenAI chat {"type": "function", "function": {"name"}};
            // Responses {"type": "function", "name"}.
            Some("tool" | "function") => {
                let name = o
                    .get("name")
                    .or_else(|| o.get("function").and_then(|f| f.get("name")))
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("`tool_choice` needs the tool's `name`".into()))?;
                named(name)
            }
            _ => Err(bad(format!("unsupported `tool_choice` {}", Value::Object(o.clone())))),
        },
        Some(other) => Err(bad(format!("`tool_choice` must be a string or an object, found {other}"))),
    }
}

/// `tool_choice: none`: the tools are not shown, and the DSML marker that opens a call is
/// masked, so no call can come out.
pub fn ban_tool_calls(spec: &mut dsv4_engine::LogitsSpec, dsml: u32) {
    spec.penalties.logit_bias.push((dsml, -1e9));
}

/// Whether a request's `tool_choice` is `none` (either API's spelling).
pub fn choice_is_none(choice: Option<&Value>) -> bool {
    match choice {
        Some(Value::String(s)) => s == "none",
        Some(o) => o.get("type").and_then(Value::as_str) == Some("none"),
        None => false,
    }
}

/// Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialise")
}

/// A literal in which each DSML marker is the marker's own token (`<[id]>`), as the model
/// writes it, not its bytes.
/// Newlines, `<` and a `/` after it are lexemes of their own: alternatives that share them
/// (another parameter or the end of the call after a newline) then stay apart until they differ;
/// one literal `"\n</"` would hold the lexer to it past the point where the paths split.
fn dsml_lit(s: &str, dsml: u32) -> String {
    let mut items = Vec::new();
    for (i, part) in s.split(DSML).enumerate() {
        if i > 0 {
            items.push(format!("<[{dsml}]>"));
        }
        let mut cur = String::new();
        let mut prev = ' ';
        for c in part.chars() {
            if c == '\n' || c == '<' || (c == '/' && prev == '<') {
                if !cur.is_empty() {
                    items.push(lit(&cur));
                    cur.clear();
                }
                items.push(lit(&c.to_string()));
            } else {
                cur.push(c);
            }
            prev = c;
        }
        if !cur.is_empty() {
            items.push(lit(&cur));
        }
    }
    items.join(" ")
}

/// Compact JSON for the schema of one parameter, as a `%json` grammar item.
fn json_item(schema: &Value) -> String {
    let mut s = match schema {
        Value::Object(_) => schema.clone(),
        _ => serde_json::json!({}),
    };
    if let Value::Object(m) = &mut s {
        // The encoder's (Python's) separators: what the model saw in every rendered call.
        m.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    format!("%json {s}")
}

/// The Lark grammar of one DSML tool-call block calling one of `tools`, exactly as the encoder
/// renders calls (`render_tool_calls`): every declared parameter in schema order, required ones
/// always, optional ones maybe, each value JSON (`string="false"`) that satisfies its schema.
pub fn tool_call_grammar(tools: &[Tool], dsml: u32) -> String {
    let mut rules = Vec::new();
    let mut invokes = Vec::new();
    for (k, tool) in tools.iter().enumerate() {
        let props: Vec<(String, Value)> = tool
            .parameters
            .get("properties")
            .and_then(Value::as_object)
            .map(|m| m.iter().map(|(a, b)| (a.clone(), b.clone())).collect())
            .unwrap_or_default();
        let required: Vec<&str> = tool
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let n = props.len();
        for (i, (name, schema)) in props.iter().enumerate() {
            let open = format!("<{DSML}parameter name=\"{name}\" string=\"false\">");
            let close = dsml_lit(&format!("</{DSML}parameter>"), dsml);
            rules.push(format!("p{k}_{i}: {} {} {close}", dsml_lit(&open, dsml), json_item(schema)));
        }
        // t{k}_{i}: parameters i.. each after a newline; h{k}_{i}: the first one without.
        let mut t_next: Option<String> = None;
        let mut h_next: Option<String> = None;
        for i in (0..n).rev() {
            let req = required.contains(&props[i].0.as_str());
            let tail = t_next.clone().unwrap_or_default();
            let t = if req { format!("\"\\n\" p{k}_{i} {tail}") } else { format!("(\"\\n\" p{k}_{i})? {tail}") };
            let h = match (req, &h_next) {
                (true, _) => format!("p{k}_{i} {tail}"),
                (false, Some(h)) => format!("p{k}_{i} {tail} | {h}"),
                (false, None) => format!("(p{k}_{i} {tail})?"),
            };
            rules.push(format!("t{k}_{i}: {t}"));
            rules.push(format!("h{k}_{i}: {h}"));
            t_next = Some(format!("t{k}_{i}"));
            h_next = Some(format!("h{k}_{i}"));
        }
        let head = dsml_lit(&format!("<{DSML}invoke name=\"{}\">\n", tool.name), dsml);
        let end = dsml_lit(&format!("\n</{DSML}invoke>"), dsml);
        rules.push(format!("inv{k}: {head} {} {end}", h_next.unwrap_or_default()));
        invokes.push(format!("inv{k}"));
    }
    let open = dsml_lit(&format!("\n\n<{DSML}tool_calls>\n"), dsml);
    let close = dsml_lit(&format!("\n</{DSML}tool_calls>"), dsml);
    let mut g = format!("start: {open} ({}) {close}\n", invokes.join(" | "));
    for r in rules {
        g.push_str(&r);
        g.push('\n');
    }
    g
}

/// The grammar for a shape (None: unconstrained).
pub fn grammar_of(shape: &Shape, dsml: u32) -> Option<GrammarSpec> {
    match shape {
        Shape::Free => None,
        Shape::Json(g) => Some(g.clone()),
        Shape::ToolCall(tools) => Some(GrammarSpec::Lark(tool_call_grammar(tools, dsml))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_grammar_accepts_what_the_encoder_renders() {
        let tok = dsv4_tokenizer::Tokenizer::deepseek_v4().unwrap();
        let json: Value = serde_json::from_str(&tok.hf().to_string(false).unwrap()).unwrap();
        let env = dsv4_engine::GrammarEnv::from_tokenizer_json(&json, tok.vocab_size(), tok.special.eos).unwrap();
        let tool = Tool {
            name: "add".into(),
            description: None,
            parameters: serde_json::json!({"type": "object", "properties": {
                "n": {"type": "integer"}, "xs": {"type": "array", "items": {"type": "integer"}},
                "opt": {"type": "boolean"}}, "required": ["n", "xs"]}),
        };
        let g =
            env.compile(&GrammarSpec::Lark(tool_call_grammar(std::slice::from_ref(&tool), tok.special.dsml))).unwrap();
        // The encoder's own rendering of a call (JSON values are `string="false"`).
        let block = |args: &str| {
            let mut m = dsv4_chat::Message::assistant("");
            m.tool_calls.push(dsv4_chat::ToolCall { id: "c".into(), name: "add".into(), arguments: args.into() });
            let text = dsv4_chat::encode_chat(
                &[dsv4_chat::Message::user("x"), m],
                std::slice::from_ref(&tool),
                &Default::default(),
            )
            .unwrap();
            // The last block: the system prompt's tool instructions hold an example one.
            let start = text.rfind("\n\n<｜DSML｜tool_calls>").unwrap();
            let end = text.rfind("</｜DSML｜tool_calls>").unwrap() + "</｜DSML｜tool_calls>".len();
            tok.encode(&text[start..end], false).unwrap()
        };
        assert!(g.accepts(&block(r#"{"n": 3, "xs": [1, 2]}"#)));
        assert!(g.accepts(&block(r#"{"n": 3, "xs": [], "opt": true}"#)));
        // A required parameter missing, or a value of the wrong type, does not match.
        assert!(!g.accepts(&block(r#"{"xs": [1]}"#)));
        assert!(!g.accepts(&block(r#"{"n": [1], "xs": [1]}"#)));
    }
}
