#!/usr/bin/env python3
"""Regenerates tokenizer_cases.json: llama.cpp's token ids for tricky strings.

Usage: python3 make_tokenizer_cases.py [MODEL.gguf] > tokenizer_cases.json
For the other pre-tokenizers, on scripts/fetch-test-models.sh's random models (SmolLM2's
vocabulary, each family's pre-tokenizer):
  make_tokenizer_cases.py models/requant/random-llama.gguf > tokenizer_cases.llama-bpe.json
  make_tokenizer_cases.py models/requant/random-qwen2.gguf > tokenizer_cases.qwen2.json
and Gemma's SentencePiece vocabulary:
  make_tokenizer_cases.py models/requant/gemma-3-270m-q4_k_m.gguf > tokenizer_cases.gemma3.json
Needs `pip install llama-cpp-python==0.3.36` (only the vocabulary is loaded).
"""
import json
import os
import sys

import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "..", "..", "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

TEXTS = [
    "12345",
    "abc 123 4.5 x1y22",
    "I'm sure you'll see they've done it, didn't they? We'd, she's, I'M, YOU'LL",
    "Hello,   world!    multiple     spaces",
    "line1\nline2\n\nline3\r\n",
    "  \n\n  x",
    "héllo wörld 日本語 🙂",
    "def f(x):\n\treturn x * 2\t# tabs\n\t\tpass\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end|><|endoftext|><filename>main.rs<|im_start|",
    "price: $3.14, 1,000,000 items; 2024-05-01T10:30:00Z",
    "DON'T SHOUT'S 'quoted' \"double\" ''",
    "",
    " ",
    "   ",
    " leading and trailing space ",
    "x²+y³ = Ⅻ ٣٤ ½",
    "e\u0301te\u0301 \u0915\u093e\u0930",
    "\u00a0nbsp\u3000ideographic\u2003em",
    "👨‍👩‍👧‍👦 family 🇫🇷 flag",
    "Привет мир! مرحبا بالعالم",
    "https://example.com/path?q=1&r=2#frag",
    "====----....!!!???",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
    "1234567 x12345y 3.14159 +12,345.678",
    "WE'RE I'M 'Ll it'S they'D",
    "(x) [y] {z} \tif\t\tfor\n\twhile",
    "a.\n\n\tb!!\r\n\r\n  c  \n",
    "control \x00\x01\x07 bell \x1b[31mred\x1b[0m \x7f",
    "tabs\t\t\tand   \n   \n\n\n    spaces",
    "中文文本，标点。日本語のテキスト！한국어 텍스트",
    "emoji 🎉🎉 mixed🙂text 👍🏽 and ☕️",
]


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    cases = []
    for text in TEXTS:
        for special in (False, True):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            cases.append({"text": text, "parse_special": special, "ids": ids})
    json.dump(
        {"model": os.path.basename(model), "generator": "llama-cpp-python " + llama_cpp.__version__, "cases": cases},
        sys.stdout,
        ensure_ascii=False,
        indent=1,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
