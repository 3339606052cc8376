#!/usr/bin/env python3
"""llama.cpp's score of every prompt token (what `echo` with `logprobs` reports), and its
log-likelihoods on the lm-eval task shipped in tests/data/lm_eval, for Airlock's tests.

Runs SmolLM2-135M-Instruct Q4_1 through llama-cpp-python with logits_all=True and reads
llama.cpp's raw logits for every prompt row: token i scores the log-softmax (float64, here) of
row i-1 at token i; the first token has no score. The prompts are tests/data/reference.json's.

It does not take the scores from create_completion(echo=True): in llama-cpp-python 0.3.36 those
are shifted by one position (token i is scored by row i, the distribution of the token after
it; abetlen/llama-cpp-python#1983), and the echo leaves out the generated token. The script
records that answer too (`llama_cpp_python_echo`), so the shift can be seen, and what
lm-evaluation-harness gets from llama-cpp-python's own server (`--server`, lm-eval's `gguf`
model, the client lm-eval ships for that server) on the same task.

Writes OUT (default tests/data/reference_prompt_logprobs.json):
  cases[]:  name, prompt_tokens, scores (null first), top (per row: the 5 best [id, logprob])
  lm_eval:  per document, each choice's log-likelihood (the context tokenized on its own, the
            continuation's tokens summed, as lm-eval's local-completions scores it) and the
            accuracy that gives

Needs: llama-cpp-python==0.3.36 numpy (and for --server: fastapi uvicorn sse-starlette
starlette-context pydantic-settings lm_eval). Built for AVX2 like tests/data/reference.json
(CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"),
so `--kernels ggml-exact-avx2` follows its arithmetic.
Usage: python3 scripts/reference/make_prompt_logprobs.py [--model PATH] [--out FILE] [--server]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "reference_prompt_logprobs.json"
REFERENCE = REPO_ROOT / "tests" / "data" / "reference.json"
TASK = REPO_ROOT / "tests" / "data" / "lm_eval" / "capitals_and_facts.jsonl"
TOP = 5


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    top = row.max()
    return row - (top + np.log(np.exp(row - top).sum()))


def prompt_scores(llm, tokens: list[int]) -> tuple[list, list]:
    """Each token's score under the row before it, and each row's best tokens."""
    llm.reset()
    llm.eval(tokens)
    rows = np.asarray(llm.scores[: len(tokens)])
    scores: list = [None]
    top: list = [None]
    for i in range(1, len(tokens)):
        logprobs = log_softmax(rows[i - 1])
        scores.append(float(logprobs[tokens[i]]))
        best = np.argsort(-logprobs, kind="stable")[:TOP]
        top.append([[int(t), float(logprobs[t])] for t in best])
    return scores, top


def tokenize(llm, text: str) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=False, special=False)


def lm_eval_scores(llm) -> dict:
    docs = [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]
    every = []
    right = 0
    for doc in docs:
        context = tokenize(llm, doc["context"])
        choices = []
        for choice in doc["choices"]:
            whole = tokenize(llm, doc["context"] + choice)
            scores, _ = prompt_scores(llm, whole)
            choices.append(sum(scores[len(context):]))
        every.append(choices)
        right += int(np.argmax(choices)) == doc["gold"]
    return {"task": str(TASK.relative_to(REPO_ROOT)), "loglikelihoods": every,
            "accuracy": right / len(docs)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_lm_eval(model: Path) -> dict:
    """lm-eval's `gguf` client against llama-cpp-python's server on the same task."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
         "--logits_all", "true", "--n_ctx", "2048", "--n_threads", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import lm_eval
        from lm_eval.tasks import TaskManager

        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "airlock_facts.yaml").write_text(
                "task: airlock_facts\ndataset_path: json\n"
                f"dataset_kwargs:\n  data_files:\n    test: {TASK}\n"
                "test_split: test\noutput_type: multiple_choice\n"
                'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
                'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\n'
                "metric_list:\n  - metric: acc\n"
            )
            results = lm_eval.simple_evaluate(
                model="gguf", model_args=f"base_url={base}", tasks=["airlock_facts"],
                task_manager=TaskManager(include_path=folder),
            )
        return {"client": "lm_eval gguf", "lm_eval_version": lm_eval.__version__,
                "accuracy": results["results"]["airlock_facts"]["acc,none"]}
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--server", action="store_true",
                        help="also run lm-eval against llama-cpp-python's server")
    args = parser.parse_args()

    import llama_cpp

    llm = llama_cpp.Llama(str(args.model), n_ctx=2048, n_batch=512, n_threads=2,
                          n_threads_batch=2, logits_all=True, verbose=False, seed=0)
    reference = json.loads(REFERENCE.read_text())
    cases = []
    for case in reference["cases"]:
        tokens = case["prompt_tokens"]
        scores, top = prompt_scores(llm, tokens)
        cases.append({"name": case["name"], "prompt_tokens": tokens, "scores": scores,
                      "top": top})
        print(f"{case['name']}: {len(tokens)} tokens", file=sys.stderr)
    llm.reset()
    first_prompt = llm.detokenize(reference["cases"][0]["prompt_tokens"]).decode()
    shown = llm.create_completion(first_prompt, max_tokens=1, echo=True, logprobs=1,
                                  temperature=0)
    echo = shown["choices"][0]["logprobs"]
    out = {
        "format": 1,
        "generator": "scripts/reference/make_prompt_logprobs.py",
        "engine": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}",
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model_file": args.model.name,
        "settings": {"n_ctx": 2048, "n_batch": 512, "n_threads": 2, "logits_all": True},
        "scores_note": "token i: log-softmax (float64) of llama.cpp's logits row i-1 at token i",
        "cases": cases,
        "lm_eval": lm_eval_scores(llm),
        "llama_cpp_python_echo": {
            "case": reference["cases"][0]["name"],
            "token_logprobs": [None if v is None else float(v)
                               for v in echo["token_logprobs"]],
            "note": "create_completion(echo=True, logprobs=1): shifted by one position "
                    "(abetlen/llama-cpp-python#1983); compare with cases[0].scores",
        },
    }
    if args.server:
        out["llama_cpp_python_server"] = server_lm_eval(args.model)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}: lm-eval accuracy {out['lm_eval']['accuracy']:.3f}"
          + (f", llama-cpp-python's server {out['llama_cpp_python_server']['accuracy']:.3f}"
             if args.server else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
