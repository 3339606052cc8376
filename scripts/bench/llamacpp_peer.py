#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (via llama-cpp-python) on the same GGUF as Airlock.

Measures, on CPU with --threads N:
  prefill_512_tok_s : 512-token prompt, one llm.eval() after llm.reset(), n_batch 512
  decode_128_tok_s  : 128 tokens at batch 1 (argmax + eval of one token) after a
                      short 16-token prompt, fresh (reset) context each rep
Each is repeated --reps times after one untimed warm-up; the median is printed as
one JSON line on stdout.

Needs: pip install llama-cpp-python==0.3.36 numpy   (not needed by CI/tests)
Usage: python3 scripts/bench/llamacpp_peer.py --threads 1 [--reps 5] [--model PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompt import bench_prompt_tokens  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFILL_TOKENS = 512
DECODE_PROMPT_TOKENS = 16
DECODE_TOKENS = 128


def make_llama(llama_cpp, model: Path, threads: int):
    kwargs = dict(model_path=str(model), n_ctx=2048, n_batch=512, n_threads=threads,
                  n_threads_batch=threads, seed=0, logits_all=False, n_gpu_layers=0,
                  verbose=False)
    params = inspect.signature(llama_cpp.Llama.__init__).parameters
    if "n_ubatch" in params:
        kwargs["n_ubatch"] = 512
    # Same settings as the reference data: flash attention off, f16 KV cache.
    if "flash_attn_type" in params:
        kwargs["flash_attn_type"] = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if "flash_attn" in params:
        kwargs["flash_attn"] = False
    return llama_cpp.Llama(**kwargs)


def last_logits(llama_cpp, llm, n_vocab: int) -> np.ndarray:
    # eval() with logits_all=False leaves llm.scores unfilled; read llama.cpp's buffer.
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))


def run_prefill(llm, prompt: list[int]) -> float:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    dt = time.perf_counter() - t0
    return len(prompt) / dt


def run_decode(llama_cpp, llm, n_vocab: int, prompt: list[int], n: int) -> float:
    llm.reset()
    llm.eval(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        t = int(np.argmax(last_logits(llama_cpp, llm, n_vocab)))
        llm.eval([t])
    dt = time.perf_counter() - t0
    return n / dt


def main() -> int:
    ap = argparse.ArgumentParser(description="llama.cpp peer benchmark")
    ap.add_argument("--threads", type=int, required=True, choices=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--dump-prompt", type=Path, default=None,
                    help="also write the 512 prompt token ids as JSON to this file")
    args = ap.parse_args()

    import llama_cpp

    llm = make_llama(llama_cpp, args.model, args.threads)
    n_vocab = llm.n_vocab()
    prompt = bench_prompt_tokens(
        lambda b: llm.tokenize(b, add_bos=False, special=False), PREFILL_TOKENS)
    short = prompt[:DECODE_PROMPT_TOKENS]
    if args.dump_prompt:
        args.dump_prompt.write_text(json.dumps(
            {"generator": "scripts/bench/bench_prompt.py bench_prompt_tokens(n=512, seed=512)",
             "tokens": prompt}) + "\n")

    # Warm-up (page in weights, allocate compute buffers).
    run_prefill(llm, prompt)
    run_decode(llama_cpp, llm, n_vocab, short, 8)

    prefill, decode = [], []
    for _ in range(args.reps):
        prefill.append(run_prefill(llm, prompt))
        decode.append(run_decode(llama_cpp, llm, n_vocab, short, DECODE_TOKENS))

    out = {
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "threads": args.threads,
        "prefill_512_tok_s": round(statistics.median(prefill), 1),
        "decode_128_tok_s": round(statistics.median(decode), 1),
        "reps": args.reps,
        "prompt_tokens_len": len(prompt),
        "prompt_tokens_sha256": hashlib.sha256(
            json.dumps(prompt, separators=(",", ":")).encode()).hexdigest(),
        "decode_prompt_tokens_len": len(short),
        "flash_attn": False,
        "prefill_all_tok_s": [round(x, 1) for x in prefill],
        "decode_all_tok_s": [round(x, 1) for x in decode],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
