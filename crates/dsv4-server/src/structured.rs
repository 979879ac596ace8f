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
fn dsml_lit(s: &str, dsml: u32) -> String {
    s.split(DSML)
        .map(|p| if p.is_empty() { String::new() } else { lit(p) })
        .collect::<Vec<_>>()
        .join(&format!(" <[{dsml}]> "))
}

/// Compact JSON for the schema of one parameter, as a `%json` grammar item.
fn json_item(schema: &Value) -> String {
    let mut s = match schema {
        Value::Object(_) => schema.clone(),
        _ => serde_json::json!({}),
    };
    if let Value::Object(m) = &mut s {
        m.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
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
    fn tool_grammar_has_every_parameter_and_the_block() {
        let t = Tool {
            name: "get_weather".into(),
            description: None,
            parameters: serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}),
        };
        let g = tool_call_grammar(&[t], 7);
        assert!(g.contains("p0_0:") && g.contains("p0_1:") && g.contains("inv0:"));
        assert!(g.contains("\"<\" <[7]> \"tool_calls>\\n\""), "{g}");
    }
}
