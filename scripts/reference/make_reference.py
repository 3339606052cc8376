#!/usr/bin/env python3
"""Produce llama.cpp reference data for Airlock's engine tests.

Runs SmolLM2-135M-Instruct Q4_1 through llama-cpp-python (greedy, CPU) on six
fixed prompts and writes:

  OUT/reference.json                  prompts, prompt token ids, 64 greedy token ids,
                                      decoded text, settings, versions, model sha256
  OUT/reference_logits/<name>.f32     the full first-step logits (next token after
                                      the prompt), n_vocab float32 little-endian

Generation never stops at EOS: exactly 64 tokens are produced by a manual
eval()/argmax loop, so the Rust engine can be compared token by token.

Needs: pip install llama-cpp-python==0.3.36 numpy   (not needed by CI/tests)
Usage: python3 scripts/reference/make_reference.py [--model PATH] [--out DIR]

For the requantized files of scripts/fetch-test-models.sh (tests/data/formats/<TYPE>/):
  make_reference.py --model models/requant/SmolLM2-135M-Instruct.<TYPE>.gguf \
      --out tests/data/formats/<TYPE> --top-logits 20

tests/data/ holds a run on an AVX2 machine (logits too); tests/data/reference_avx512/
holds reference.json of a run on an AVX-512 machine (--out /tmp/x, then copy the
json): llama.cpp's own results differ between the two builds, and the tests use
that spread as the yardstick for the fast kernels. Each case records the sha256 of its
first-step logits: `--kernels ggml-exact` must reproduce the AVX-512 build's bit for bit
(crates/model/tests/it/exact.rs). Build llama-cpp-python for the machine
(CMAKE_ARGS="-DGGML_NATIVE=ON", the default) so its CPU features match the reference's.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import random
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO_ROOT / "tests" / "data"
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

N_NEW = 64
N_CTX = 2048
N_BATCH = 512
N_THREADS = 2
SEED = 0

# The GGUF's tokenizer.chat_template, rendered by hand (no jinja dependency):
# {% for message in messages %}
#   {% if loop.first and messages[0]['role'] != 'system' %}<default system>{% endif %}
#   <|im_start|>{role}\n{content}<|im_end|>\n
# {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}
DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n"
)


def render_chat(messages: list[dict]) -> str:
    out = []
    if messages and messages[0]["role"] != "system":
        out.append(DEFAULT_SYSTEM)
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


# Fixed vocabulary for the long prompt; with random.Random(1234) the text is fully
# determined by this file (it does not depend on the tokenizer).
_CITY = "Veltrano"
_PLACES = ["harbor", "old market", "glass bridge", "north gate", "library", "river quarter",
           "clock tower", "salt warehouses", "hill gardens", "canal district", "observatory",
           "weavers' lane", "eastern docks", "stone amphitheater", "lantern square"]
_PEOPLE = ["fishermen", "merchants", "scribes", "glassblowers", "students", "ferrymen",
           "bakers", "astronomers", "weavers", "masons", "musicians", "council members"]
_VERBS = ["gather", "trade", "argue", "sing", "repair boats", "sell spices", "study maps",
          "light lanterns", "count coins", "paint murals", "measure the tides", "tell stories"]
_TIMES = ["at dawn", "every morning", "in the late afternoon", "after the spring rains",
          "during the winter festival", "when the bells ring", "on market days", "at dusk",
          "before the first frost", "each summer"]
_ADJS = ["narrow", "crowded", "quiet", "ancient", "windy", "colorful", "busy", "shaded",
         "crooked", "sunlit", "famous", "forgotten"]
_THINGS = ["copper roofs", "blue tiles", "wooden bridges", "tall chimneys", "iron lamps",
           "stone fountains", "painted doors", "covered arcades", "grain barges", "paper kites"]
_FACTS = [
    "The city was founded {n} years ago by settlers from the southern coast.",
    "About {n} thousand people live there today.",
    "Its largest ship carried {n} barrels of olive oil on a single voyage.",
    "The council meets {n} times each year in the town hall.",
    "Visitors count {n} bridges crossing the main canal.",
]


def long_prompt_text(n_sentences: int = 75) -> str:
    rng = random.Random(1234)
    sentences = []
    for _ in range(n_sentences):
        kind = rng.randrange(4)
        if kind == 0:
            s = (f"In the {rng.choice(_ADJS)} {rng.choice(_PLACES)} of {_CITY}, the "
                 f"{rng.choice(_PEOPLE)} {rng.choice(_VERBS)} {rng.choice(_TIMES)}.")
        elif kind == 1:
            s = (f"The {rng.choice(_PLACES)} is known for its {rng.choice(_THINGS)} and "
                 f"{rng.choice(_ADJS)} streets.")
        elif kind == 2:
            s = rng.choice(_FACTS).format(n=rng.randrange(2, 900))
        else:
            s = (f"{rng.choice(_TIMES).capitalize()}, {rng.choice(_PEOPLE)} and "
                 f"{rng.choice(_PEOPLE)} {rng.choice(_VERBS)} near the {rng.choice(_PLACES)}.")
        sentences.append(s)
    # Paragraphs of 5 sentences.
    paras = [" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)]
    return f"A description of the city of {_CITY}.\n\n" + "\n\n".join(paras) + "\n\nSummary:"


PROMPTS = [
    {"name": "capital_france", "mode": "plain", "prompt": "The capital of France is"},
    {"name": "code_fibonacci", "mode": "plain", "prompt": "def fibonacci(n):\n"},
    {"name": "apollo_digits", "mode": "plain",
     "prompt": "In 1969, Apollo 11 landed on the Moon. Three facts about it:\n1."},
    {"name": "chat_boiling", "mode": "chat",
     "messages": [{"role": "user", "content": "What is the boiling point of water?"}]},
    {"name": "chat_system_colors", "mode": "chat",
     "messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "List three colors."}]},
    {"name": "long_city", "mode": "plain", "prompt": long_prompt_text()},
]
LONG_RANGE = (1000, 1400)

# A second set, fixed before any engine was compared against it (tests/data/reference_more/,
# made with --set more on an AVX-512 machine): more plain and chat prompts, so exact 64-token
# agreement is judged over more than the six prompts above, all of them reported.
MORE_PROMPTS = [
    {"name": "more_water_cycle", "mode": "plain",
     "prompt": "The water cycle has four main stages:"},
    {"name": "more_reverse_list", "mode": "plain",
     "prompt": "# Python: reverse a list\ndef reverse_list(items):\n"},
    {"name": "more_village_story", "mode": "plain",
     "prompt": "Once upon a time, in a small village by the sea,"},
    {"name": "chat_photosynthesis", "mode": "chat",
     "messages": [{"role": "user", "content": "Explain photosynthesis in two sentences."}]},
    {"name": "chat_haiku", "mode": "chat",
     "messages": [{"role": "user", "content": "Write a haiku about autumn."}]},
    {"name": "chat_translate", "mode": "chat",
     "messages": [{"role": "system", "content": "You translate English to French."},
                  {"role": "user", "content": "Good morning, how are you?"}]},
]
SETS = {"core": PROMPTS, "more": MORE_PROMPTS}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_llama(llama_cpp, model: Path):
    kwargs = dict(model_path=str(model), n_ctx=N_CTX, n_batch=N_BATCH, n_threads=N_THREADS,
                  n_threads_batch=N_THREADS, seed=SEED, logits_all=False, n_gpu_layers=0,
                  verbose=False)
    params = inspect.signature(llama_cpp.Llama.__init__).parameters
    if "n_ubatch" in params:
        kwargs["n_ubatch"] = N_BATCH
    # Flash attention off, explicitly. Newer llama.cpp has a tri-state
    # flash_attn_type (auto/on/off) whose default "auto" may turn it on.
    if "flash_attn_type" in params:
        kwargs["flash_attn_type"] = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if "flash_attn" in params:
        kwargs["flash_attn"] = False
    llm = llama_cpp.Llama(**kwargs)
    return llm, {k: v for k, v in kwargs.items() if k not in ("model_path", "verbose")}


def last_logits(llama_cpp, llm) -> np.ndarray:
    """Logits of the last token of the most recent eval() as a fresh float32 copy.

    With logits_all=False, llama-cpp-python's eval() does not fill llm.scores (its
    sampling happens inside llama.cpp's sampler), so read llama.cpp's buffer directly.
    """
    n_vocab = llm.n_vocab()
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    if not ptr:
        raise RuntimeError("llama_get_logits_ith(-1) returned NULL")
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32, copy=True)


def detok(llm, toks: list[int]) -> str:
    try:
        b = llm.detokenize(toks, special=True)
    except TypeError:
        b = llm.detokenize(toks)
    return b.decode("utf-8", errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--set", choices=sorted(SETS), default="core",
                    help="which prompts: the six core ones, or the second set")
    ap.add_argument("--top-logits", type=int, metavar="N",
                    help="store only the N largest first-step logits (ids and values) in the "
                         "json instead of writing logits files (for the other model files)")
    ap.add_argument("--add-bos", action="store_true",
                    help="start every prompt with the model's BOS token (for models that "
                         "expect it, as Gemma does); recorded as \"add_bos\": true")
    args = ap.parse_args()

    import llama_cpp  # imported late so --help works without it

    model_sha = sha256_file(args.model)
    if model_sha != EXPECTED_SHA256:
        print(f"warning: model sha256 {model_sha} != expected {EXPECTED_SHA256}",
              file=sys.stderr)

    llm, settings = make_llama(llama_cpp, args.model)
    n_vocab = llm.n_vocab()
    eos = llm.token_eos()

    # What the context actually got (flash attention / KV types as seen by llama.cpp).
    cparams = llm.context_params
    effective = {}
    for field in ("n_ctx", "n_batch", "n_ubatch", "n_threads", "n_threads_batch",
                  "flash_attn", "flash_attn_type", "type_k", "type_v", "logits_all",
                  "embeddings", "offload_kqv"):
        if hasattr(cparams, field):
            v = getattr(cparams, field)
            effective[field] = v if isinstance(v, (int, float, bool)) else str(v)
    ggml_type_names = {1: "f16", 0: "f32", 8: "q8_0"}
    for f in ("type_k", "type_v"):
        if f in effective and isinstance(effective[f], int):
            effective[f + "_name"] = ggml_type_names.get(effective[f], str(effective[f]))
    fa_names = {getattr(llama_cpp, n): n for n in dir(llama_cpp)
                if n.startswith("LLAMA_FLASH_ATTN_TYPE_")}
    if isinstance(effective.get("flash_attn_type"), int):
        effective["flash_attn_type_name"] = fa_names.get(effective["flash_attn_type"], "?")

    args.out.mkdir(parents=True, exist_ok=True)
    logits_dir = args.out / "reference_logits"
    if args.top_logits is None:
        logits_dir.mkdir(parents=True, exist_ok=True)

    cases = []
    for p in SETS[args.set]:
        name = p["name"]
        if p["mode"] == "chat":
            text = render_chat(p["messages"])
            toks = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        else:
            text = p["prompt"]
            toks = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        if args.add_bos:
            toks = [llm.token_bos()] + toks
        if name == "long_city" and not (LONG_RANGE[0] <= len(toks) <= LONG_RANGE[1]):
            raise SystemExit(f"long prompt has {len(toks)} tokens, want {LONG_RANGE}")

        llm.reset()
        llm.eval(toks)
        first = last_logits(llama_cpp, llm)
        assert first.shape == (n_vocab,) and np.isfinite(first).all()
        if args.top_logits is None:
            (logits_dir / f"{name}.f32").write_bytes(first.astype("<f4").tobytes())

        out, margins, logits = [], [], first
        for step in range(N_NEW):
            top2 = np.argsort(logits)[::-1][:2]
            t = int(np.argmax(logits))  # first index on ties
            margins.append(float(logits[top2[0]] - logits[top2[1]]))
            out.append(t)
            if step + 1 < N_NEW:
                llm.eval([t])
                logits = last_logits(llama_cpp, llm)

        case = {
            "name": name,
            "mode": p["mode"],
            "prompt": text,
        }
        if p["mode"] == "chat":
            case["messages"] = p["messages"]
        case.update({
            "prompt_tokens": [int(t) for t in toks],
            "n_prompt_tokens": len(toks),
            "greedy_tokens": out,
            "greedy_text": detok(llm, out),
            "eos_positions": [i for i, t in enumerate(out) if t == eos],
            "top1_top2_margins": [round(m, 6) for m in margins],
            "first_logits_sha256": hashlib.sha256(first.astype("<f4").tobytes()).hexdigest(),
            "first_logits_argmax": int(np.argmax(first)),
            "first_logits_max": float(first.max()),
        })
        if args.top_logits is None:
            case["first_logits_file"] = f"reference_logits/{name}.f32"
        else:
            top = np.argsort(first)[::-1][:args.top_logits]
            case["first_logits_top"] = [[int(t), float(first[t])] for t in top]
        cases.append(case)
        print(f"{name}: {len(toks)} prompt tokens -> {case['greedy_text'][:80]!r}",
              file=sys.stderr)

    system_info = llama_cpp.llama_print_system_info()
    if isinstance(system_info, bytes):
        system_info = system_info.decode("utf-8", errors="replace")

    ref = {
        "format": 1,
        "generator": "scripts/reference/make_reference.py",
        "engine": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_system_info": system_info.strip(),
        "model_file": args.model.name,
        "model_sha256": model_sha,
        "n_vocab": n_vocab,
        "eos_token_id": eos,
        "bos_token_id": llm.token_bos(),
        "add_bos": args.add_bos,
        "n_new_tokens": N_NEW,
        "sampling": "greedy argmax over raw logits (lowest index on ties); "
                    "no stop at EOS; manual eval() loop",
        "logits_format": "first-step logits for the token after the prompt: "
                         "n_vocab float32 little-endian",
        "settings": {**settings, "type_k": "f16 (default)", "type_v": "f16 (default)",
                     "flash_attn": False, "device": "CPU"},
        "effective_context_params": effective,
        "chat_template_note": "rendered by the script exactly as the GGUF's "
                              "tokenizer.chat_template with add_generation_prompt=true",
        "cases": cases,
    }
    (args.out / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out / 'reference.json'} and {len(cases)} logits files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
