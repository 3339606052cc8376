#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (via llama-cpp-python) on the same GGUF as Airlock.

Measures, on CPU with --threads N:
  prefill_tok_s : a --prefill-tokens prompt (512), one llm.eval() after llm.reset(),
                  n_batch 512
  decode_tok_s  : --decode-tokens (128) at batch 1 (argmax + eval of one token) after a
                  --decode-depth prompt (16), fresh (reset) context each rep
Each is repeated --reps times after one untimed warm-up; the median is printed as
one JSON line on stdout.

Needs: pip install llama-cpp-python==0.3.36 numpy   (not needed by CI/tests)
Usage: python3 scripts/bench/llamacpp_peer.py --threads 1 [--reps 5] [--model PATH]
           [--prefill-tokens 512] [--decode-tokens 128] [--decode-depth 16]
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


def make_llama(llama_cpp, model: Path, threads: int, n_ctx: int):
    kwargs = dict(model_path=str(model), n_ctx=n_ctx, n_batch=512, n_threads=threads,
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
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-depth", type=int, default=16)
    ap.add_argument("--dump-prompt", type=Path, default=None,
                    help="also write the prefill prompt's token ids as JSON to this file")
    args = ap.parse_args()

    import llama_cpp

    longest = max(args.prefill_tokens, args.decode_depth)
    n_ctx = max(2048, longest + args.decode_tokens + 8)
    llm = make_llama(llama_cpp, args.model, args.threads, n_ctx)
    n_vocab = llm.n_vocab()
    text = bench_prompt_tokens(
        lambda b: llm.tokenize(b, add_bos=False, special=False), longest)
    prompt, short = text[:args.prefill_tokens], text[:args.decode_depth]
    if args.dump_prompt:
        args.dump_prompt.write_text(json.dumps(
            {"generator": f"scripts/bench/bench_prompt.py bench_prompt_tokens("
                          f"n={args.prefill_tokens}, seed=512)",
             "tokens": prompt}) + "\n")

    # Warm-up (page in weights, allocate compute buffers).
    run_prefill(llm, prompt)
    run_decode(llama_cpp, llm, n_vocab, short, 8)

    prefill, decode = [], []
    for _ in range(args.reps):
        prefill.append(run_prefill(llm, prompt))
        decode.append(run_decode(llama_cpp, llm, n_vocab, short, args.decode_tokens))

    out = {
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "threads": args.threads,
        "prefill_tokens": args.prefill_tokens,
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "decode_tokens": args.decode_tokens,
        "decode_depth": args.decode_depth,
        "decode_tok_s": round(statistics.median(decode), 1),
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
