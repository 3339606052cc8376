"""Drives `airlock serve` with the official openai client: chat and completions, streaming and
not, as two tenants; a wrong key must raise AuthenticationError.

Usage: openai_client.py BASE_URL KEY_A KEY_B MODEL
"""
import sys

import openai

base_url, key_a, key_b, model = sys.argv[1:5]


def check_tenant(key: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    models = [m.id for m in client.models.list()]
    assert models == [model], models

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        seed=1,
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content, chat
    assert chat.choices[0].finish_reason in ("stop", "length"), chat
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0, chat.usage

    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == chat.choices[0].message.content, (pieces, chat)
    assert finish in ("stop", "length"), finish
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text.startswith(" Paris"), completion
    streamed = "".join(
        choice.text
        for chunk in client.completions.create(
            model=model,
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        for choice in chunk.choices
    )
    assert streamed == completion.choices[0].text, (streamed, completion)


check_tenant(key_a)
check_tenant(key_b)

bad = openai.OpenAI(base_url=base_url, api_key="sk-wrong-key-000000", max_retries=0)
try:
    bad.completions.create(model=model, prompt="hi", max_tokens=1)
except openai.AuthenticationError as error:
    assert error.status_code == 401
else:
    raise AssertionError("a wrong key was accepted")

try:
    openai.OpenAI(base_url=base_url, api_key=key_a, max_retries=0).completions.create(
        model=model, prompt="word " * 9000, max_tokens=1
    )
except openai.BadRequestError as error:
    assert error.status_code == 400
    assert "context" in str(error), error
else:
    raise AssertionError("an oversized prompt got 200")

print("all openai client checks passed")
