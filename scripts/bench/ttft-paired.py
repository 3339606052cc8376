#!/usr/bin/env python3
"""Time to first token of two running servers, measured in pairs.

    scripts/bench/ttft-paired.py unified=http://127.0.0.1:18501 serve=http://127.0.0.1:18502 \
        [--tokens 1024,4096] [--pairs 9]

`airlock bench --sweep prompt-tokens=...` measures one server after the other, so on a shared
machine whose speed drifts by several per cent from minute to minute the drift lands in the
ratio. This script sends each prompt to both servers back to back (which goes first alternates),
so each pair sees the same machine, and reports the median of the per-pair ratios beside each
server's median. Every prompt is new to both servers (a numbered prefix), so no prefix cache
helps, and each request asks for one greedy token without streaming: its latency is the time
to the first token plus one response. Prompts are made of plain words to about the asked
token count; the count each server reports (`usage.prompt_tokens`) is printed, and must be the
same for both in each pair.

Start the servers first, e.g. `airlock unified --port 18501` and `airlock serve --port 18502`
(both with the same --threads; an idle server's compute threads sleep).
"""

import argparse
import json
import statistics
import sys
import time
import urllib.request

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact river stone cloud table window "
    "music paper light water house story night money month book study word business issue side "
    "kind head service friend father power hour game line end member law car city community"
).split()


def post(url, body):
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        answer = json.load(response)
    return time.perf_counter() - started, answer


def prompt(serial, words):
    # A different word order per prompt as well as the number: nothing is shared past the
    # first token or two.
    step = 7 + 2 * (serial % 5)
    body = " ".join(WORDS[(serial * 13 + i * step) % len(WORDS)] for i in range(words))
    return f"{serial}: {body}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("servers", nargs=2, help="NAME=URL, the reference first")
    parser.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma separated")
    parser.add_argument("--pairs", type=int, default=9, help="pairs per prompt length")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    servers = [s.split("=", 1) for s in args.servers]
    if any(len(s) != 2 for s in servers):
        sys.exit("each server is NAME=URL")
    (ref_name, ref_url), (name, url) = servers

    # Words per token of these prompts, from one short request.
    _, answer = post(ref_url, {"model": args.model, "prompt": prompt(0, 400), "max_tokens": 1})
    tokens_per_word = answer["usage"]["prompt_tokens"] / 400
    serial = int(time.time()) % 100000 * 1000
    print(f"| prompt tokens | {ref_name} ms p50 | {name} ms p50 | {name} / {ref_name} per pair: p50 (min–max) | pairs |")
    print("|---|---|---|---|---|")
    for target in [int(t) for t in args.tokens.split(",")]:
        words = int(target / tokens_per_word)
        times = {ref_name: [], name: []}
        ratios = []
        counts = set()
        for pair in range(args.pairs):
            serial += 1
            text = prompt(serial, words)
            order = [(ref_name, ref_url), (name, url)]
            if pair % 2:
                order.reverse()
            seen, counted = {}, set()
            for who, where in order:
                body = {"model": args.model, "prompt": text, "max_tokens": 1, "temperature": 0}
                seconds, answer = post(where, body)
                seen[who] = seconds
                counted.add(answer["usage"]["prompt_tokens"])
            if len(counted) != 1:
                sys.exit(f"the servers counted different prompt lengths: {sorted(counted)}")
            counts |= counted
            for who in times:
                times[who].append(seen[who] * 1000)
            ratios.append(seen[name] / seen[ref_name])
            print(
                f"  {target} pair {pair + 1}: {ref_name} {seen[ref_name] * 1000:.0f} ms, "
                f"{name} {seen[name] * 1000:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
        span = f"{min(counts)}" if len(counts) == 1 else f"{min(counts)}–{max(counts)}"
        print(
            f"| {span} | {statistics.median(times[ref_name]):.0f} | "
            f"{statistics.median(times[name]):.0f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}–{max(ratios):.3f}) | {args.pairs} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
