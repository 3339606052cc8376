//! Tool calls: OpenAI's `tools`, `tool_choice`, assistant `tool_calls` and `tool` messages,
//! on a model whose chat template has no tool support (the served model's has none). The
//! fallback, documented in the README: the tools are described in the system prompt as JSON;
//! a call is the JSON object `{"name": ..., "arguments": {...}}`, which decoding is held to
//! (the called function's parameter schema included) when `tool_choice` requires a call;
//! with `auto` the answer is a call when it is such an object naming a tool; earlier calls
//! and their results go back into the conversation as that JSON and as `tool` turns.

use crate::error::ApiError;
use crate::responses::FinishReason;
use serde::Serialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;

/// A declared function.
#[derive(Clone, Debug)]
pub struct Tool {
    pub name: String,
    description: Option<String>,
    /// A JSON schema of the arguments object.
    parameters: Value,
}

/// What the request allows or asks of its answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// No tools, or `none`: plain text.
    Text,
    /// Text or a call.
    Auto,
    /// A call to one of the tools.
    Required,
    /// A call to this tool.
    Named(String),
}

/// How a job's answer is read back: the tool names a call may use.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolUse {
    pub names: Vec<String>,
}

/// One call in an answer, as OpenAI returns it.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct ToolCall {
    pub function: FunctionCall,
    pub id: String,
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^function$")]
    pub kind: &'static str,
}

#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct FunctionCall {
    /// The arguments object, as JSON text.
    pub arguments: String,
    pub name: String,
}

/// `tools` and `tool_choice`, checked.
pub fn parse(
    tools: Option<Vec<Value>>,
    choice: Option<Value>,
) -> Result<(Vec<Tool>, Choice), ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            format!("at most {MAX_TOOLS} tools"),
            "tools",
        ));
    }
    let mut parsed: Vec<Tool> = Vec::with_capacity(tools.len());
    for (index, tool) in tools.iter().enumerate() {
        let field = format!("tools[{index}]");
        let bad = |what: &str| ApiError::invalid(format!("{field}: {what}"), field.clone());
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("type must be \"function\""));
        }
        let function = tool
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("function must be an object"))?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .filter(|name| valid_name(name))
            .ok_or_else(|| bad("function.name must be 1 to 64 letters, digits, _ or -"))?;
        if parsed.iter().any(|t| t.name == name) {
            return Err(bad("two tools have this name"));
        }
        for key in function.keys() {
            if !matches!(
                key.as_str(),
                "name" | "description" | "parameters" | "strict"
            ) {
                return Err(ApiError::invalid(
                    format!("Unrecognized request argument supplied: {key}"),
                    format!("{field}.function.{key}"),
                ));
            }
        }
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(schema) if schema.is_object() => schema.clone(),
            Some(_) => return Err(bad("function.parameters must be a JSON schema object")),
        };
        parsed.push(Tool {
            name: name.to_string(),
            description: function
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        });
    }
    let choice = match choice {
        None | Some(Value::Null) if parsed.is_empty() => Choice::Text,
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(choice)) => match choice.as_str() {
            "none" => Choice::Text,
            "auto" if parsed.is_empty() => Choice::Text,
            "auto" => Choice::Auto,
            "required" if !parsed.is_empty() => Choice::Required,
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice must be \"none\", \"auto\", \"required\" (with tools) or \
                     {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    "tool_choice",
                ))
            }
        },
        Some(choice) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|name| parsed.iter().any(|t| t.name == *name))
                .ok_or_else(|| {
                    ApiError::invalid("tool_choice must name one of the tools", "tool_choice")
                })?;
            Choice::Named(name.to_string())
        }
    };
    Ok((parsed, choice))
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// What the system prompt gains: the tools, and how to call one.
pub fn system_text(tools: &[Tool]) -> String {
    let listed: Vec<Value> = tools
        .iter()
        .map(|tool| {
            let mut entry = Map::new();
            entry.insert("name".into(), json!(tool.name));
            if let Some(description) = &tool.description {
                entry.insert("description".into(), json!(description));
            }
            entry.insert("parameters".into(), tool.parameters.clone());
            Value::Object(entry)
        })
        .collect();
    format!(
        "You can call these functions:\n{}\nTo call one, answer with only a JSON object: \
         {{\"name\": <the function's name>, \"arguments\": <its arguments>}}.",
        Value::Array(listed)
    )
}

/// The schema of a call to one of `tools` (what a required call is held to).
pub fn call_schema(tools: &[&Tool]) -> Value {
    let calls: Vec<Value> = tools
        .iter()
        .map(|tool| {
            json!({
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    match <[Value; 1]>::try_from(calls) {
        Ok([one]) => one,
        Err(calls) => json!({"anyOf": calls}),
    }
}

/// An earlier assistant turn's `tool_calls`, as the text the model would have written.
pub fn render_calls(calls: &[Value], field: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (index, call) in calls.iter().enumerate() {
        let bad = || {
            ApiError::invalid(
                format!(
                    "{field}[{index}] must be {{\"id\", \"type\": \"function\", \"function\": \
                     {{\"name\", \"arguments\"}}}}"
                ),
                format!("{field}[{index}]"),
            )
        };
        let function = call.get("function").ok_or_else(bad)?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(bad)?;
        let arguments = match function.get("arguments") {
            Some(Value::String(text)) => serde_json::from_str(text).unwrap_or(json!(text)),
            Some(value) => value.clone(),
            None => return Err(bad()),
        };
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&json!({"name": name, "arguments": arguments}).to_string());
    }
    Ok(text)
}

impl ToolUse {
    /// The calls a finished answer makes: only one that ended on its own (not cut by
    /// `max_tokens`) can be a call.
    pub fn calls(&self, text: &str, finish: FinishReason) -> Option<Vec<ToolCall>> {
        (finish == FinishReason::Stop)
            .then(|| calls_in(text, self))
            .flatten()
    }
}

/// The calls an answer makes: a JSON object naming one of the tools, with an arguments
/// object; `None` when the answer is text.
pub fn calls_in(text: &str, tools: &ToolUse) -> Option<Vec<ToolCall>> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    let name = value.get("name")?.as_str()?;
    let arguments = value.get("arguments").filter(|a| a.is_object())?;
    if !tools.names.iter().any(|n| n == name) {
        return None;
    }
    Some(vec![ToolCall {
        function: FunctionCall {
            arguments: arguments.to_string(),
            name: name.to_string(),
        },
        id: call_id(),
        kind: "function",
    }])
}

/// A fresh call id, as OpenAI's look.
fn call_id() -> String {
    let mut bytes = [0u8; 12];
    let _ = getrandom::getrandom(&mut bytes);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("call_{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "add", "description": "Adds."}}),
        ]
    }

    #[test]
    fn choices_follow_openai_defaults() {
        let choice = |c: Option<Value>| parse(Some(tools()), c).map(|(_, c)| c);
        assert_eq!(choice(None), Ok(Choice::Auto));
        assert_eq!(choice(Some(json!("none"))), Ok(Choice::Text));
        assert_eq!(choice(Some(json!("required"))), Ok(Choice::Required));
        assert_eq!(
            choice(Some(
                json!({"type": "function", "function": {"name": "add"}})
            )),
            Ok(Choice::Named("add".into()))
        );
        assert!(choice(Some(
            json!({"type": "function", "function": {"name": "nope"}})
        ))
        .is_err());
        assert_eq!(parse(None, None).map(|(_, c)| c), Ok(Choice::Text));
        assert!(parse(None, Some(json!("required"))).is_err());
        assert!(parse(
            Some(vec![
                json!({"type": "function", "function": {"name": "a b"}})
            ]),
            None
        )
        .is_err());
    }

    #[test]
    fn an_answer_is_a_call_only_when_it_names_a_tool_with_arguments() {
        let tools = ToolUse {
            names: vec!["add".into()],
        };
        let call = calls_in(r#" {"name": "add", "arguments": {"a": 1}} "#, &tools).expect("call");
        assert_eq!(call[0].function.name, "add");
        assert_eq!(call[0].function.arguments, r#"{"a":1}"#);
        assert!(call[0].id.starts_with("call_"));
        assert!(calls_in(r#"{"name": "sub", "arguments": {}}"#, &tools).is_none());
        assert!(calls_in(r#"{"name": "add"}"#, &tools).is_none());
        assert!(calls_in("The answer is 3.", &tools).is_none());
    }

    #[test]
    fn earlier_calls_render_as_the_json_a_call_is() {
        let calls = [json!({"id": "call_1", "type": "function",
                            "function": {"name": "add", "arguments": "{\"a\": 1}"}})];
        let text = render_calls(&calls, "messages[1].tool_calls").expect("renders");
        let value: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(value, json!({"name": "add", "arguments": {"a": 1}}));
        assert!(render_calls(&[json!({"id": "x"})], "m").is_err());
    }
}
