use gguf::{ChatMessage, ChatTemplate};

use crate::common::model;

const SYSTEM: &str =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

fn template() -> ChatTemplate {
    ChatTemplate::from_gguf(&model().file).expect("the real chat template compiles")
}

#[test]
fn default_system_prompt() {
    let t = template();
    let out = t
        .render(&[ChatMessage::new("user", "Hi")], true)
        .expect("renders");
    assert_eq!(
        out,
        format!("{SYSTEM}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    );
    let no_prompt = t
        .render(&[ChatMessage::new("user", "Hi")], false)
        .expect("renders");
    assert_eq!(
        no_prompt,
        format!("{SYSTEM}<|im_start|>user\nHi<|im_end|>\n")
    );
}

#[test]
fn own_system_prompt_and_multi_turn() {
    let t = template();
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "2+2?"),
        ChatMessage::new("assistant", "4"),
        ChatMessage::new("user", "And 3+3?"),
    ];
    assert_eq!(
        t.render(&msgs, true).expect("renders"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
         <|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn special_token_strings() {
    let t = template();
    // This file's BOS is <|im_start|> (id 1) and EOS <|im_end|> (id 2).
    assert_eq!(t.bos_token(), "<|im_start|>");
    assert_eq!(t.eos_token(), "<|im_end|>");
}

#[test]
fn rendered_prompt_tokenizes_with_control_tokens() {
    let m = model();
    let prompt = template()
        .render(&[ChatMessage::new("user", "Hi")], true)
        .expect("renders");
    let ids = m.tokenizer.encode(&prompt, true);
    let im_start = m
        .tokenizer
        .token_id("<|im_start|>")
        .expect("<|im_start|> in vocab");
    let im_end = m
        .tokenizer
        .token_id("<|im_end|>")
        .expect("<|im_end|> in vocab");
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 2);
    assert_eq!(m.tokenizer.decode(&ids), prompt);
}
