"""Training mode end to end: token ids and log-probs from every source, errors, streaming, sampling pins,
and native Responses upstreams."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gymproxy.testing.fake_vllm import Script, pieces, token_id

from .test_exchange import _events


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as r:
            return r.status, orjson.loads(await r.read())


def ids(text: str) -> list[int]:
    return [token_id(p) for p in pieces(text)]


def generations(fake) -> list:
    return [r for r in fake.requests if r.path == "/v1/chat/completions"]


def tokenizes(fake) -> list:
    return [r for r in fake.requests if r.path == "/tokenize"]


@pytest.mark.parametrize("inline", [False, True])
async def test_chat_reply_carries_token_ids(start_proxy, fake_vllm, inline):
    url = await start_proxy(return_token_id_information=True, request_prompt_and_generation_token_ids=inline)
    fake_vllm.push(Script(content="alpha beta gamma"))
    status, reply = await post(
        url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "one two"}]}
    )
    assert status == 200, reply
    sent = generations(fake_vllm)[-1].json
    assert (sent["logprobs"], sent["top_logprobs"], sent["return_tokens_as_token_ids"]) == (True, 0, True)
    assert sent.get("return_token_ids") is (True if inline else None)
    message = reply["choices"][0]["message"]
    assert message["generation_token_ids"] == ids("alpha beta gamma")
    assert len(message["generation_log_probs"]) == 3 and all(v < 0 for v in message["generation_log_probs"])
    assert message["prompt_token_ids"] == ids("one two")
    assert message["routed_experts"] is None
    assert reply["choices"][0]["logprobs"] is None and "token_ids" not in reply["choices"][0]
    assert "prompt_token_ids" not in reply
    # Without inline ids the prompt comes from /tokenize on the same upstream, with the same messages.
    assert len(tokenizes(fake_vllm)) == (0 if inline else 1)
    if not inline:
        assert tokenizes(fake_vllm)[0].json["messages"] == sent["messages"]


async def test_responses_last_item_carries_token_ids_and_matches_tokenize(start_proxy, fake_vllm):
    url = await start_proxy(return_token_id_information=True, uses_reasoning_parser=True)
    fake_vllm.push(Script(content="sure", tool_calls=[{"name": "f", "arguments": "{}", "id": "c1"}]))
    status, response = await post(
        url, "/v1/responses", {"model": "m", "input": "call it", "tools": [{"type": "function", "name": "f"}]}
    )
    assert status == 200, response
    last = response["output"][-1]
    assert last["type"] == "function_call"
    assert last["prompt_token_ids"] == ids("call it")
    assert len(last["generation_token_ids"]) == len(last["generation_log_probs"]) > 0
    assert "prompt_token_ids" not in response["output"][0]
    status, tokenized = await post(
        url, "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "call it"}]}
    )
    assert tokenized["tokens"] == last["prompt_token_ids"]


async def test_token_fields_on_input_items_are_not_sent_upstream(start_proxy, fake_vllm):
    url = await start_proxy(return_token_id_information=True)
    history = [
        {"role": "user", "content": "q"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "a"}],
            "prompt_token_ids": [1],
            "generation_token_ids": [2],
            "generation_log_probs": [-0.1],
        },
        {"role": "user", "content": "again"},
    ]
    status, _ = await post(url, "/v1/responses", {"model": "m", "input": history})
    assert status == 200
    assert generations(fake_vllm)[-1].json["messages"][1] == {"content": "a", "role": "assistant"}


async def test_streamed_token_ids_equal_non_streamed(start_proxy, fake_vllm):
    url = await start_proxy(return_token_id_information=True, request_prompt_and_generation_token_ids=True)
    script = Script(content="red green blue")
    fake_vllm.push(script, script)
    _, plain = await post(url, "/v1/responses", {"model": "m", "input": "colors"})
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={"model": "m", "input": "colors", "stream": True}) as r:
            events = _events(await r.read())
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        assert final["output"][-1][key] == plain["output"][-1][key], key
    assert plain["output"][-1]["generation_token_ids"] == ids("red green blue")


async def test_streamed_token_ids_without_inline_ids_use_tokenize(start_proxy, fake_vllm):
    url = await start_proxy(return_token_id_information=True)
    fake_vllm.push(Script(content="red green"))
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={"model": "m", "input": "colors", "stream": True}) as r:
            events = _events(await r.read())
    last = events[-1]["response"]["output"][-1]
    assert last["prompt_token_ids"] == ids("colors") and last["generation_token_ids"] == ids("red green")
    assert len(tokenizes(fake_vllm)) == 1


async def test_message_bundle_wins(start_proxy, fake_vllm):
    url = await start_proxy(return_token_id_information=True)
    bundle = {"prompt_token_ids": [7, 8], "generation_token_ids": [9], "generation_log_probs": [-0.5]}
    fake_vllm.push(Script(content="x", message_extra=bundle))
    _, reply = await post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]})
    message = reply["choices"][0]["message"]
    assert [message[k] for k in bundle] == list(bundle.values())
    assert reply["choices"][0]["logprobs"] is not None  # left as is for a bundle
    assert tokenizes(fake_vllm) == []


@pytest.mark.parametrize(
    "script, needle",
    [
        (Script(content="x", message_extra={"prompt_token_ids": [1]}), "partial token metadata"),
        (
            Script(
                content="x",
                message_extra={"prompt_token_ids": [1], "generation_token_ids": [2, 3], "generation_log_probs": [-1.0]},
            ),
            "mismatched",
        ),
        (Script(content="x", top_extra={"prompt_token_ids": [1, 2]}), "missing: choice.token_ids"),
        (Script(content="x", choice_extra={"logprobs": None}), "had none"),
        (
            Script(content="x", choice_extra={"logprobs": {"content": [{"token": "hello", "logprob": -1.0}]}}),
            "token_id:<int>",
        ),
        (
            Script(content="x", choice_extra={"logprobs": {"content": [{"token": "token_id:5", "logprob": True}]}}),
            "numeric",
        ),
        (
            Script(content="a b", top_extra={"prompt_token_ids": [1]}, choice_extra={"token_ids": [1, 2]}),
            "disagree with choice logprob token IDs",
        ),
    ],
)
async def test_broken_token_contracts_are_502s(start_proxy, fake_vllm, script, needle):
    url = await start_proxy(return_token_id_information=True)
    fake_vllm.push(script)
    status, reply = await post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]})
    assert status == 502
    assert needle in reply["error"]["message"]


async def test_n_other_than_one_is_refused_in_training_mode(start_proxy, fake_vllm):
    url = await start_proxy(return_token_id_information=True)
    status, reply = await post(url, "/v1/chat/completions", {"n": 2, "messages": [{"role": "user", "content": "q"}]})
    assert status == 400 and reply["error"]["param"] == "n"
    assert generations(fake_vllm) == []


# --- sampling pins on every path -----------------------------------------------------------------

PINS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "temperature": 0.1, "top_k": 5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "temperature": 0.1, "stream": True}),
        ("/v1/responses", {"model": "m", "input": "q", "temperature": 0.1, "metadata": {"extra_body": '{"top_k": 3}'}}),
        ("/v1/responses", {"model": "m", "input": "q", "temperature": 0.1, "stream": True}),
    ],
)
async def test_sampling_overrides_win_on_every_chat_path(start_proxy, fake_vllm, path, body):
    url = await start_proxy(sampling_overrides=PINS)
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as r:
            assert r.status == 200
            await r.read()
    sent = generations(fake_vllm)[-1].json
    assert {k: sent[k] for k in PINS} == PINS


# --- native Responses upstreams ------------------------------------------------------------------


@pytest.fixture
async def native_upstream(aiohttp_server):
    """A stand-in for an upstream that serves /v1/responses itself (OpenAI, Azure, vLLM's own)."""
    seen: list[tuple[web.Request, dict]] = []
    reply = {
        "id": "resp_up",
        "object": "response",
        "created_at": 1.0,
        "model": "up",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_up",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "native!", "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((request, body))
        if not body.get("stream"):
            return web.json_response(reply)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n, kind in enumerate(("response.created", "response.completed")):
            event = {"type": kind, "sequence_number": n, "response": reply}
            await response.write(f"event: {kind}\ndata: {orjson.dumps(event).decode()}\n\n".encode())
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    return str(server.make_url("/v1")), seen


async def test_native_responses_pass_through(start_proxy, native_upstream):
    url, seen = native_upstream
    proxy = await start_proxy(
        base_url=url,
        is_responses_native=True,
        model="gpt-x",
        chat_template_kwargs={"enable_thinking": True},
        extra_body={"service_tier": "flex", "temperature": 0.9},
        sampling_overrides={"top_p": 0.5},
        default_query={"api-version": "2025-04-01-preview"},
        api_key="azure-key",
    )
    async with openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="x", max_retries=0) as client:
        response = await client.responses.create(
            model="mine", input="hi", temperature=0.2, previous_response_id="resp_0", tools=[{"type": "web_search"}]
        )
        assert response.output_text == "native!" and response.id == "resp_up"
        request, body = seen[-1]
        assert body["model"] == "gpt-x" and body["temperature"] == 0.2 and body["service_tier"] == "flex"
        assert body["top_p"] == 0.5 and body["chat_template_kwargs"] == {"enable_thinking": True}
        assert body["previous_response_id"] == "resp_0" and body["tools"] == [{"type": "web_search"}]
        assert request.query["api-version"] == "2025-04-01-preview"
        assert request.headers["Authorization"] == "Bearer azure-key"
        events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
        assert [e.type for e in events] == ["response.created", "response.completed"]
        assert seen[-1][1]["stream"] is True and seen[-1][1]["top_p"] == 0.5


@pytest.mark.parametrize(
    "clash",
    [
        {"return_token_id_information": True},
        {"replace_developer_role_with_system": True},
        {"sequential_reasoning_allowed": False},
    ],
)
def test_native_mode_refuses_options_that_cannot_apply(clash):
    from gymproxy import ConfigError, build_config

    with pytest.raises(ConfigError, match="is_responses_native"):
        build_config({"base_url": "http://x/v1", "is_responses_native": True, **clash}, environ={})
