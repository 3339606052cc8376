"""Runs lm-evaluation-harness on a small log-likelihood task shipped in tests/data/lm_eval
against a running server, with both clients lm-eval has for such a server (`local-completions`
with its remote tokenizer on /tokenize, and `gguf`, written for llama-cpp-python's server),
then scores the same task itself through /v1/completions (echo + logprobs, the sum over each
choice's tokens). Checks that every choice's log-likelihood agrees between the three, and that
the accuracy is llama.cpp's on the same file (REFERENCE, from
scripts/reference/make_prompt_logprobs.py, which reads llama.cpp's logits directly:
llama-cpp-python's server scores echoed prompts one position off and gets 0.533 there).

Usage: lm_eval_check.py BASE_URL MODEL JSONL REFERENCE
"""
import json
import os
import sys
import tempfile
import urllib.request

base_url, model, jsonl, reference_file = sys.argv[1:5]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402  (after the offline switches)
from lm_eval.tasks import TaskManager  # noqa: E402

TASK = "airlock_facts"


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.load(answer)


def own_scores(docs: list) -> list:
    """Each choice scored as lm-eval scores it: the continuation's tokens' log-probabilities,
    summed, with the context tokenized on its own."""
    every = []
    for doc in docs:
        context = post("/tokenize", {"prompt": doc["context"]})["tokens"]
        scores = []
        for choice in doc["choices"]:
            whole = post("/tokenize", {"prompt": doc["context"] + choice})["tokens"]
            answer = post(
                "/v1/completions",
                {"model": model, "prompt": whole, "max_tokens": 0, "echo": True,
                 "logprobs": 1, "temperature": 0},
            )
            logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
            scores.append(sum(logprobs[len(context):]))
        every.append(scores)
    return every


with tempfile.TemporaryDirectory() as folder:
    with open(os.path.join(folder, TASK + ".yaml"), "w") as task:
        task.write(
            f"task: {TASK}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {os.path.abspath(jsonl)}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            'doc_to_text: "{{context}}"\n'
            'doc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{gold}}"\n'
            'target_delimiter: ""\n'
            "metric_list:\n  - metric: acc\n"
        )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={model},base_url={base_url}/v1/completions,tokenizer_backend=remote,"
            "num_concurrent=1,max_retries=1,tokenized_requests=True"
        ),
        tasks=[TASK],
        task_manager=TaskManager(include_path=folder),
        log_samples=True,
    )
    # lm-eval's client for llama-cpp-python's server: text prompts, no `model` field.
    gguf = lm_eval.simple_evaluate(
        model="gguf",
        model_args=f"base_url={base_url}",
        tasks=[TASK],
        task_manager=TaskManager(include_path=folder),
        log_samples=True,
    )
harness = results["results"][TASK]["acc,none"]
harness_gguf = gguf["results"][TASK]["acc,none"]
with open(jsonl) as lines:
    docs = [json.loads(line) for line in lines]
ours = own_scores(docs)
with open(reference_file) as f:
    reference = json.load(f)["lm_eval"]
worst = {"local-completions": 0.0, "gguf": 0.0, "llama.cpp": 0.0}
for client, run in [("local-completions", results), ("gguf", gguf)]:
    for sample in run["samples"][TASK]:
        theirs = [resp[0][0] for resp in sample["resps"]]
        mine = ours[sample["doc_id"]]
        diff = max(abs(a - b) for a, b in zip(theirs, mine, strict=True))
        worst[client] = max(worst[client], diff)
for theirs, mine in zip(reference["loglikelihoods"], ours, strict=True):
    diff = max(abs(a - b) for a, b in zip(theirs, mine, strict=True))
    worst["llama.cpp"] = max(worst["llama.cpp"], diff)
right = sum(max(range(len(s)), key=s.__getitem__) == d["gold"] for s, d in zip(ours, docs))
print(
    f"lm-eval accuracy {harness:.3f} (local-completions), {harness_gguf:.3f} (gguf); the "
    f"server's own scoring {right / len(docs):.3f}; llama.cpp's {reference['accuracy']:.3f} "
    f"over {len(docs)}. Largest log-likelihood difference from ours: "
    + ", ".join(f"{name} {value:.2e}" for name, value in worst.items())
)
assert worst["local-completions"] < 1e-3 and worst["gguf"] < 1e-3, worst
# The served kernels are the fast ones: within their tolerance of llama.cpp's arithmetic.
assert worst["llama.cpp"] < 1.0, worst
assert abs(harness - right / len(docs)) < 1e-9, (harness, right)
assert abs(harness_gguf - harness) < 1e-9, (harness_gguf, harness)
assert abs(harness - reference["accuracy"]) < 1e-9, (harness, reference["accuracy"])
print("lm-eval check passed")
