"""Runs lm-evaluation-harness (`local-completions`, its remote tokenizer on /tokenize) on a
small log-likelihood task shipped in tests/data/lm_eval against a running server, then scores
the same task itself through /v1/completions (echo + logprobs, the sum over each choice's
tokens) and checks that every choice's log-likelihood, and so the accuracy, agree.

Usage: lm_eval_check.py BASE_URL MODEL JSONL
"""
import json
import os
import sys
import tempfile
import urllib.request

base_url, model, jsonl = sys.argv[1:4]
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
harness = results["results"][TASK]["acc,none"]
with open(jsonl) as lines:
    docs = [json.loads(line) for line in lines]
ours = own_scores(docs)
worst = 0.0
for sample in results["samples"][TASK]:
    theirs = [resp[0][0] for resp in sample["resps"]]
    mine = ours[sample["doc_id"]]
    worst = max(worst, max(abs(a - b) for a, b in zip(theirs, mine, strict=True)))
right = sum(max(range(len(s)), key=s.__getitem__) == d["gold"] for s, d in zip(ours, docs))
print(
    f"lm-eval accuracy {harness:.3f}, the server's own scoring {right / len(docs):.3f} over "
    f"{len(docs)}; largest log-likelihood difference {worst:.2e}"
)
assert worst < 1e-3, worst
assert abs(harness - right / len(docs)) < 1e-9, (harness, right)
assert harness > 0.5, f"a model this size gets most of these right: {harness}"
print("lm-eval check passed")
