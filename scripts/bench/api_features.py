#!/usr/bin/env python3
"""Before/after timings of two OpenAI API paths, two `airlock` binaries alternating in one run:

  choices  one request at a time with `n: 4` on a long prompt (distinct per request, so only
           the request's own choices can share it): seconds per request
  grammar  8 concurrent chat requests with a `json_schema` response_format: generated tokens
           per second over the batch

Each binary serves on its own port (`serve`, or `unified` with --mode, default kernels);
rounds alternate A, B, A, B... and the script prints medians and the ratio B/A.

Usage: api_features.py BINARY_A BINARY_B [--mode serve|unified] [--rounds 5]
                       [--prompt-sentences 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompt import bench_prompt_text  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "population", "landmarks"],
    "additionalProperties": False,
}


def post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)


def start(binary: str, mode: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([binary, mode, "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if " at http://" in line:
            base = line.split(" at ", 1)[1].split()[0].rstrip("/").removesuffix("/v1")
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, base
    raise SystemExit(f"{binary} did not start")


def choices(base: str, round_: int, sentences: int) -> float:
    prompt = f"Request {round_}-{time.time_ns()}. " + bench_prompt_text(seed=round_,
                                                                        n_sentences=sentences)
    started = time.perf_counter()
    answer = post(base, "/v1/completions", {"model": MODEL, "prompt": prompt, "n": 4,
                                            "max_tokens": 16, "ignore_eos": True,
                                            "temperature": 1.0})
    assert len(answer["choices"]) == 4
    return time.perf_counter() - started


def grammar(base: str, round_: int) -> float:
    tokens = []

    def one(i: int) -> None:
        answer = post(base, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 64, "temperature": 1.0, "seed": round_ * 100 + i,
            "messages": [{"role": "user", "content": f"Describe city number {i} as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "city", "schema": SCHEMA}}})
        tokens.append(answer["usage"]["completion_tokens"])

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("binary_a")
    parser.add_argument("binary_b")
    parser.add_argument("--mode", choices=["serve", "unified"], default="serve")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-sentences", type=int, default=60)
    args = parser.parse_args()
    servers = {name: start(binary, args.mode) for name, binary in
               [("A", args.binary_a), ("B", args.binary_b)]}
    results = {(name, kind): [] for name in servers for kind in ("choices", "grammar")}
    try:
        for _, base in servers.values():  # warm up both
            choices(base, 0, args.prompt_sentences)
            grammar(base, 0)
        for round_ in range(1, args.rounds + 1):
            for name, (_, base) in servers.items():
                results[(name, "choices")].append(choices(base, round_, args.prompt_sentences))
                results[(name, "grammar")].append(grammar(base, round_))
            print(f"round {round_}: " + ", ".join(
                f"{name} {kind} {values[-1]:.3f}" for (name, kind), values in results.items()),
                file=sys.stderr)
    finally:
        for process, _ in servers.values():
            process.terminate()
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"{args.mode}: n=4 on a {args.prompt_sentences}-sentence prompt, seconds per request (median of "
          f"{args.rounds}): A {median[('A', 'choices')]:.3f}, B {median[('B', 'choices')]:.3f}, "
          f"B/A {median[('B', 'choices')] / median[('A', 'choices')]:.2f}")
    print(f"{args.mode}: json_schema x8 concurrent, generated tok/s (median of {args.rounds}): "
          f"A {median[('A', 'grammar')]:.1f}, B {median[('B', 'grammar')]:.1f}, "
          f"B/A {median[('B', 'grammar')] / median[('A', 'grammar')]:.2f}")


if __name__ == "__main__":
    main()
