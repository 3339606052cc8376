"""Drives `airlock serve` with the official openai client: chat and completions, streaming and
not, as two tenants; a wrong key must raise AuthenticationError; sampling draws afresh
without a seed and reproduces with one; logit_bias bans a token; the fields Airlock cannot
honour are refused with 400 naming them, and the no-op ones are accepted; structured output
parses through the client; a tools round trip.

Usage: openai_client.py BASE_URL KEY_A KEY_B MODEL
"""
import json
import sys
import urllib.request

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


def check_sampling(key: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]

    def texts(**extra):
        return [
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=16, temperature=1, **extra
            )
            .choices[0]
            .message.content
            for _ in range(10)
        ]

    unseeded = texts()
    assert len(set(unseeded)) >= 8, unseeded
    seeded = texts(seed=7)
    assert len(set(seeded)) == 1, seeded

    # The greedy next token of this prompt, banned with a bias of -100, never comes out of
    # 50 completions sampled at temperature 1 (it is the likeliest, so without the bias it
    # would come out of most of them).
    prompt = "The capital of France is"
    greedy = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    banned_text = greedy.choices[0].text
    request = urllib.request.Request(
        base_url.removesuffix("/v1") + "/tokenize",
        data=json.dumps({"model": model, "prompt": prompt + banned_text}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        tokenized = json.load(answer)["tokens"]
    banned = tokenized[-1]
    unbiased = [
        client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=1)
        .choices[0]
        .text
        for _ in range(50)
    ]
    assert unbiased.count(banned_text) >= 10, (banned_text, unbiased)
    biased = [
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=1,
            temperature=1,
            logit_bias={str(banned): -100},
        )
        .choices[0]
        .text
        for _ in range(50)
    ]
    assert banned_text not in biased, (banned_text, biased)

    # The rest of the sampling settings, as the client sends them.
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        extra_body={"min_p": 0.05, "top_k": 40, "repetition_penalty": 1.1},
        user="user-1",
        metadata={"suite": "openai_client"},
        store=False,
    )
    assert chat.choices[0].message.content is not None, chat

    scored = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens, scored
    assert all(len(token.top_logprobs) == 2 for token in content), content

    echoed = client.completions.create(
        model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    assert echoed.text == prompt, echoed
    assert echoed.logprobs.token_logprobs[0] is None, echoed.logprobs
    assert all(lp <= 0 for lp in echoed.logprobs.token_logprobs[1:]), echoed.logprobs

    three = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=1, n=3
    )
    assert sorted(choice.index for choice in three.choices) == [0, 1, 2], three

    for extra, param in [
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 17}, "n"),
    ]:
        try:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2, **extra)
        except openai.BadRequestError as error:
            assert error.status_code == 400 and error.param == param, (param, error)
        else:
            raise AssertionError(f"{param} was accepted")


def check_structured_output(key: str) -> None:
    """Structured output through the client's own parser: 20 of 20 answers validate."""
    import pydantic

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=24)
        country: str = pydantic.Field(max_length=24)
        population_millions: int = pydantic.Field(ge=0, le=100)
        is_capital: bool

    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Describe the city of Paris."},
    ]
    for seed in range(20):
        parsed = client.chat.completions.parse(
            model=model,
            messages=messages,
            response_format=City,
            max_tokens=120,
            temperature=1,
            seed=seed,
        )
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, City), choice.message


def check_tools(key: str) -> None:
    """A tools round trip: two tools, a required call whose arguments validate, its result
    sent back."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    tools = [
        {"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {
            "name": "add", "description": "Adds two integers.",
            "parameters": {"type": "object",
                           "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"], "additionalProperties": False}}},
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # Greedy: at temperature 1 the schema still lets the city string run on past max_tokens
    # now and then, which says nothing about the round trip.
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=60,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    wanted = {"get_weather": {"city"}, "add": {"a", "b"}}[call.function.name]
    assert set(arguments) == wanted, arguments
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"})
    follow_up = client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=16
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls"), follow_up


check_tenant(key_a)
check_tenant(key_b)
check_sampling(key_a)
check_tools(key_a)
check_structured_output(key_b)

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
