"""Both endpoints on vLLM's /v1/completions (`use_completions_api`), end to end with the openai client."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from gymproxy.testing.fake_vllm import Script, pieces, token_id

from .test_completions_convert import TEMPLATE, save_tokenizer
from .test_exchange import _events
from .test_routes import OVERFLOW_032


def completions(fake) -> list:
    return [r for r in fake.requests if r.path == "/v1/completions"]


@pytest.fixture
async def backend(start_proxy):
    url = await start_proxy(use_completions_api=True, model="base", sampling_overrides={"top_k": 7})
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        yield url, client


async def test_responses_raw_prompt_and_reply(backend, fake_vllm):
    _, client = backend
    fake_vllm.push(Script(content="Paris."))
    response = await client.responses.create(
        model="m", input="Capital of France?", instructions="Answer briefly.", max_output_tokens=20
    )
    assert response.output_text == "Paris." and response.model == "base"
    sent = completions(fake_vllm)[-1].json
    assert sent["prompt"] == "Answer briefly.\n\nCapital of France?"
    assert sent["model"] == "base" and sent["max_tokens"] == 20 and sent["top_k"] == 7
    assert "messages" not in sent


async def test_chat_through_completions(backend, fake_vllm):
    _, client = backend
    fake_vllm.push(Script(content="four"))
    completion = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2?"}], temperature=0.3
    )
    assert completion.choices[0].message.content == "four"
    assert completion.object == "chat.completion"
    assert completions(fake_vllm)[-1].json["temperature"] == 0.3


async def test_streams_through_completions(backend, fake_vllm):
    _, client = backend
    fake_vllm.push(Script(content="one two three"), Script(content="alpha beta"))
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "stream_options" not in completions(fake_vllm)[-1].json  # the chat client did not ask for usage
    events = [e async for e in await client.responses.create(model="m", input="x", stream=True)]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "alpha beta"
    assert completions(fake_vllm)[-1].json["stream_options"] == {"include_usage": True}
    assert events[-1].response.usage is not None


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ]
            },
            "messages",
        ),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
async def test_raw_mode_refusals_name_the_problem(backend, fake_vllm, body, param):
    url, _ = backend
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={"model": "m", **body}) as r:
            reply = orjson.loads(await r.read())
            assert r.status == 400, reply
    assert reply["error"]["param"] == param
    assert completions(fake_vllm) == []


async def test_overflow_through_completions(backend, fake_vllm):
    _, client = backend
    fake_vllm.push(Script(status=400, error_message=OVERFLOW_032))
    response = await client.responses.create(model="m", input="x")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("prompt_ids_from_vllm", [True, False])
async def test_training_token_ids_through_completions(start_proxy, fake_vllm, prompt_ids_from_vllm):
    url = await start_proxy(use_completions_api=True, return_token_id_information=True)
    extra = None if prompt_ids_from_vllm else {"prompt_token_ids": None}
    fake_vllm.push(Script(content="red green", choice_extra=extra))
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={"model": "m", "input": "colors please"}) as r:
            response = orjson.loads(await r.read())
    sent = completions(fake_vllm)[-1].json
    assert sent["return_token_ids"] is True and sent["return_tokens_as_token_ids"] is True and sent["logprobs"] == 0
    last = response["output"][-1]
    assert last["generation_token_ids"] == [token_id(p) for p in pieces("red green")]
    assert last["prompt_token_ids"] == [token_id(p) for p in pieces("colors please")]
    assert len(last["generation_log_probs"]) == 2
    tokenized = [r for r in fake_vllm.requests if r.path == "/tokenize"]
    assert len(tokenized) == (0 if prompt_ids_from_vllm else 1)
    if not prompt_ids_from_vllm:
        assert tokenized[0].json["prompt"] == "colors please"


async def test_training_token_ids_when_streaming_through_completions(start_proxy, fake_vllm):
    url = await start_proxy(use_completions_api=True, return_token_id_information=True)
    fake_vllm.push(Script(content="red green blue"))
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={"model": "m", "input": "colors", "stream": True}) as r:
            events = _events(await r.read())
    last = events[-1]["response"]["output"][-1]
    assert last["generation_token_ids"] == [token_id(p) for p in pieces("red green blue")]
    assert last["prompt_token_ids"] == [token_id(p) for p in pieces("colors")]


async def test_chat_template_mode(start_proxy, fake_vllm, tmp_path):
    path = save_tokenizer(tmp_path / "tok", TEMPLATE)
    url = await start_proxy(
        use_completions_api=True,
        render_chat_template=True,
        tokenizer=path,
        chat_template_kwargs={"enable_thinking": True},
    )
    fake_vllm.push(Script(content="sunny"))
    history = [
        {"role": "user", "content": "what is the weather"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        response = await client.responses.create(model="m", input=history, tools=tools)
    assert response.output_text == "sunny"
    assert completions(fake_vllm)[-1].json["prompt"] == (
        "<tools>weather;</tools>\n<|user|>what is the weather\n<|assistant|>[call weather]\n<|tool|>sunny\n<|assistant|><think>"
    )


def test_chat_template_mode_fails_at_startup_without_a_template(tmp_path):
    from gymproxy import ConfigError, build_config, create_app

    path = save_tokenizer(tmp_path / "bare", None)
    config = build_config(
        {"base_url": "http://x/v1", "use_completions_api": True, "render_chat_template": True, "tokenizer": path},
        environ={},
    )
    with pytest.raises(ConfigError, match="chat template"):
        create_app(config)
