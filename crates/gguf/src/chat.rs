//! Rendering chat messages into a prompt with the model's Jinja chat template
//! (`tokenizer.chat_template`).
//!
//! The environment mirrors Hugging Face's `apply_chat_template`:
//! `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`.strip()`, `.startswith()`...) available, and `raise_exception(msg)`
//! turning into an [`Error::Template`].

use minijinja::value::Value as JinjaValue;
use minijinja::{Environment, ErrorKind};

use crate::{Error, GgufFile, Result, Value};

const TEMPLATE_NAME: &str = "chat_template";
const KEY_TEMPLATE: &str = "tokenizer.chat_template";

/// ChatML turns: what a file without a template of its own is served with.
const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n\
{{ message['content'] }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Gemma's turns (`<start_of_turn>user` … `<end_of_turn>`, the assistant's role named
/// `model`, no system role: a system message opens the first user turn), BOS first.
const GEMMA_TURNS: &str = "{{ bos_token }}{% set system = namespace(text='') %}\
{% for message in messages %}{% if message['role'] == 'system' %}\
{% set system.text = system.text + message['content'] + '\n\n' %}{% else %}\
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n\
{% if message['role'] == 'user' %}{{ system.text }}{% set system.text = '' %}{% endif %}\
{{ message['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}\
{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`...
    pub role: String,
    pub content: String,
    /// The participant's name, given to the template as `name` when set.
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
        }
    }
}

/// A compiled chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the strings the
    /// template sees as `bos_token` and `eos_token`.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        let source = source.into();
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template in `tokenizer.chat_template`, with the BOS and EOS token
    /// texts taken from the vocabulary (empty when the file names none).
    pub fn from_gguf(file: &GgufFile) -> Result<ChatTemplate> {
        ChatTemplate::with_tokens_of(file, file.get_str(KEY_TEMPLATE)?)
    }

    /// The file's template, or where it has none the turn format of its family (Gemma's for
    /// `gemma3`, ChatML otherwise, as llama.cpp falls back to ChatML); the flag says
    /// whether it is the file's own.
    pub fn from_gguf_or_family(file: &GgufFile) -> Result<(ChatTemplate, bool)> {
        if file.get(KEY_TEMPLATE).is_some() {
            return Ok((ChatTemplate::from_gguf(file)?, true));
        }
        let source = match file.get_str("general.architecture") {
            Ok("gemma3") => GEMMA_TURNS,
            _ => CHATML,
        };
        Ok((ChatTemplate::with_tokens_of(file, source)?, false))
    }

    /// `source`, seeing the file's BOS and EOS token texts.
    fn with_tokens_of(file: &GgufFile, source: &str) -> Result<ChatTemplate> {
        let token_text = |key: &str| -> Result<String> {
            let Some(_) = file.get(key) else {
                return Ok(String::new());
            };
            let id = file.get_u32(key)? as usize;
            Ok(file
                .get_array("tokenizer.ggml.tokens")?
                .get(id)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string())
        };
        ChatTemplate::new(
            source,
            token_text("tokenizer.ggml.bos_token_id")?,
            token_text("tokenizer.ggml.eos_token_id")?,
        )
    }

    /// Renders `messages`; with `add_generation_prompt` the prompt ends with
    /// the template's opening of an assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let messages: Vec<JinjaValue> = messages
            .iter()
            .map(|m| {
                let name = m
                    .name
                    .as_deref()
                    .map(|name| ("name", JinjaValue::from(name)));
                JinjaValue::from_iter(
                    [
                        ("role", JinjaValue::from(m.role.as_str())),
                        ("content", JinjaValue::from(m.content.as_str())),
                    ]
                    .into_iter()
                    .chain(name),
                )
            })
            .collect();
        let ctx = JinjaValue::from_iter([
            ("messages", JinjaValue::from(messages)),
            (
                "add_generation_prompt",
                JinjaValue::from(add_generation_prompt),
            ),
            ("bos_token", JinjaValue::from(self.bos_token.as_str())),
            ("eos_token", JinjaValue::from(self.eos_token.as_str())),
        ]);
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|t| t.render(ctx))
            .map_err(template_error)
    }

    /// The template's Jinja text, as the model file holds it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` string given to the template.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The `eos_token` string given to the template.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

fn raise_exception(message: String) -> std::result::Result<JinjaValue, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

fn template_error(err: minijinja::Error) -> Error {
    Error::Template {
        message: err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The turn formats a file without a template gets: Gemma's (system folded into the
    /// first user turn, the assistant named `model`, BOS first) and ChatML.
    #[test]
    fn family_turn_formats_render_as_their_models_expect() {
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", " Hi "),
            ChatMessage::new("assistant", "Hello."),
            ChatMessage::new("user", "Bye"),
        ];
        let gemma = ChatTemplate::new(GEMMA_TURNS, "<bos>", "<eos>").expect("compiles");
        assert_eq!(
            gemma.render(&msgs, true).expect("renders"),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        let chatml = ChatTemplate::new(CHATML, "", "").expect("compiles");
        assert_eq!(
            chatml.render(&msgs[1..2], true).expect("renders"),
            "<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn renders_messages_and_special_strings() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m['content'] }}\n{% endfor %}\
             {% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}",
            "<s>",
            "</s>",
        )
        .expect("test template compiles");
        let msgs = [
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Yo"),
        ];
        assert_eq!(
            t.render(&msgs, true).expect("renders"),
            "<s>[user]Hi\n[assistant]Yo\n[assistant]</s>"
        );
        assert_eq!(t.render(&[], false).expect("renders"), "<s></s>");
    }

    #[test]
    fn a_name_reaches_the_template_only_when_set() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}: \
             {{ m.content }};{% endfor %}",
            "",
            "",
        )
        .expect("test template compiles");
        let mut named = ChatMessage::new("user", "Hi");
        named.name = Some("ada".into());
        let msgs = [named, ChatMessage::new("user", "Yo")];
        assert_eq!(
            t.render(&msgs, false).expect("renders"),
            "user(ada): Hi;user: Yo;"
        );
    }

    #[test]
    fn trims_blocks_like_hugging_face() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content.strip() }}\n  {% endif %}\n{% endfor %}",
            "",
            "",
        )
        .expect("test template compiles");
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  x  ")], false)
                .expect("renders"),
            "x\n"
        );
    }

    #[test]
    fn errors_are_values() {
        let err = ChatTemplate::new("{% for %}", "", "").expect_err("syntax error must fail");
        assert!(matches!(err, Error::Template { .. }), "{err}");
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "")
            .expect("test template compiles");
        let err = t.render(&[], false).expect_err("raise_exception must fail");
        assert!(err.to_string().contains("no system role"), "{err}");
        let t = ChatTemplate::new("{{ messages[5].content.upper() }}", "", "")
            .expect("test template compiles");
        assert!(matches!(t.render(&[], false), Err(Error::Template { .. })));
    }
}
