"""Deterministic benchmark prompts shared by Airlock's benchmark scripts.

The text is fully determined by this file (fixed word lists, random.Random(seed)),
so any engine with the SmolLM2 tokenizer gets the same token ids. The ids actually
used can be dumped with `llamacpp_peer.py --dump-prompt FILE` for engines that
cannot run Python.
"""

from __future__ import annotations

import random

_SUBJECTS = ["the river", "a lighthouse keeper", "the old railway", "our neighbor",
             "the committee", "a small bakery", "the museum", "every student",
             "the mountain village", "a tired engineer", "the orchestra", "the city library"]
_VERBS = ["described", "repaired", "painted", "measured", "visited", "remembered",
          "organized", "photographed", "explained", "ignored", "celebrated", "rebuilt"]
_OBJECTS = ["the wooden bridge", "a forgotten map", "the harbor walls", "twelve lanterns",
            "the winter market", "an unusual clock", "the garden path", "three old boats",
            "the copper roof", "a long letter", "the stone stairs", "the morning train"]
_TAILS = ["before sunrise", "in the rain", "with great care", "for the first time",
          "after a long debate", "without a plan", "during the festival", "near the coast",
          "in 1887", "at 4:30 pm", "for 250 coins", "on the 3rd of May"]


def bench_prompt_text(seed: int = 512, n_sentences: int = 80) -> str:
    rng = random.Random(seed)
    parts = []
    for i in range(n_sentences):
        s = (f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
             f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}.")
        parts.append(s)
        if i % 6 == 5:
            parts.append("\n\n")
        else:
            parts.append(" ")
    return "".join(parts).strip()


def bench_prompt_tokens(tokenize, n_tokens: int = 512, seed: int = 512) -> list[int]:
    """First n_tokens ids of the benchmark text.

    `tokenize(bytes) -> list[int]` must tokenize without BOS and without special
    tokens (llama-cpp-python: lambda b: llm.tokenize(b, add_bos=False, special=False)).
    """
    n_sentences = 80
    while True:
        toks = tokenize(bench_prompt_text(seed, n_sentences).encode("utf-8"))
        if len(toks) >= n_tokens:
            return [int(t) for t in toks[:n_tokens]]
        n_sentences *= 2
