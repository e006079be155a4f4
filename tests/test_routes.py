"""gymproxy.routes end to end over real sockets: the openai client -> gymproxy -> the fake vLLM, non-streaming."""

from __future__ import annotations

import asyncio
import io

import aiohttp
import openai
import orjson
import pytest

from gymproxy.testing.fake_vllm import Script

OVERFLOW_032 = (
    "This model's maximum context length is 512 tokens. However, your prompt contains at least 513 input "
    "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
    "prompt. (parameter=input_tokens, value=513)"
)
OVERFLOW_FLAT = (
    b'{"object":"error","message":"This model\'s maximum context length is 32768 tokens. However, you requested '
    b'32818 tokens in the messages, Please reduce the length of the messages. None","type":"BadRequestError",'
    b'"param":null,"code":400}'
)
TOO_MANY_OUTPUT = (
    "max_tokens=1000 cannot be greater than max_model_len=512. Please request fewer output tokens. "
    "(parameter=max_tokens, value=1000)"
)


async def post(url: str, path: str, body: bytes | dict, **kwargs) -> tuple[int, dict]:
    data = io.BytesIO(body if isinstance(body, bytes) else orjson.dumps(body))
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}, **kwargs) as r:
            return r.status, orjson.loads(await r.read())


# --- /v1/responses ---------------------------------------------------------------------------


async def test_responses_text_turn(client, fake_vllm):
    response = await client.responses.create(model="anything", input="hello there")
    assert response.output_text == "echo: hello there"
    assert response.status == "completed"
    assert response.model == "policy"
    sent = fake_vllm.last_json()
    assert sent["model"] == "policy"
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    assert "stream" not in sent
    assert response.usage.input_tokens > 0 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )
    # The fake, as vLLM, reports `prompt_tokens_details: null`: the Response still carries integers.
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0


async def test_responses_reasoning_and_tool_call(client, fake_vllm):
    fake_vllm.push(
        Script(
            content="Let me look.",
            reasoning="the user wants weather",
            tool_calls=[{"name": "get_weather", "arguments": '{"city":"Paris"}', "id": "call_1"}],
        )
    )
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}]
    response = await client.responses.create(model="m", input="weather?", tools=tools)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response.output[0].summary[0].text == "the user wants weather"
    assert response.output[1].content[0].text == "Let me look."
    call = response.output[2]
    assert (call.name, call.arguments, call.call_id, call.id) == ("get_weather", '{"city":"Paris"}', "call_1", "call_1")
    sent = fake_vllm.last_json()
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert response.tools[0].strict is True  # echoed as sent, stripped only upstream


async def test_responses_multi_turn_history_reaches_vllm_split(client, fake_vllm):
    history = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "need tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}]
    await client.responses.create(model="m", input=history, tools=tools, instructions="Be brief.")
    sent = fake_vllm.last_json()
    assert sent["messages"] == [
        {"content": "Be brief.", "role": "system"},
        {"role": "user", "content": "weather?"},
        {
            "content": "",
            "role": "assistant",
            "tool_calls": [{"id": "c1", "function": {"arguments": "{}", "name": "get_weather"}, "type": "function"}],
            "reasoning_content": "need tool",
            "reasoning": "need tool",
        },
        {"content": "sunny", "role": "tool", "tool_call_id": "c1"},
    ]


async def test_responses_sampling_and_metadata_controls(client, fake_vllm):
    await client.responses.create(
        model="m",
        input="hi",
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=64,
        reasoning={"effort": "low"},
        metadata={"extra_body": '{"top_k": 5}', "chat_template_kwargs": '{"enable_thinking": false}', "run": "7"},
    )
    sent = fake_vllm.last_json()
    assert sent["temperature"] == 0.5 and sent["top_p"] == 0.9
    assert sent["max_tokens"] == 64 and sent["reasoning_effort"] == "low"
    assert sent["top_k"] == 5
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["metadata"] == {"run": "7"}


async def test_responses_context_overflow_is_an_empty_incomplete_answer(client, fake_vllm):
    fake_vllm.push(Script(status=400, error_message=OVERFLOW_032))
    response = await client.responses.create(model="m", input="long")
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == ""


async def test_responses_context_overflow_flat_envelope(client, fake_vllm):
    fake_vllm.push(Script(status=400, error_body=OVERFLOW_FLAT))
    response = await client.responses.create(model="m", input="long")
    assert response.status == "incomplete"


async def test_responses_overflow_propagated_when_configured(start_proxy, fake_vllm):
    url = await start_proxy(propagate_context_overflow_errors=True)
    fake_vllm.push(Script(status=400, error_message=OVERFLOW_032))
    status, body = await post(url, "/v1/responses", {"model": "m", "input": "x"})
    assert status == 400
    assert body["error"]["message"] == OVERFLOW_032


# Spaced and with a key order no encoder of ours would produce, so a re-encoded body cannot pass.
OVERFLOW_SPACED = (
    b'{ "error" : {"code": 400, "type": "BadRequestError", "message": "' + OVERFLOW_032.encode() + b'",'
    b' "param": "input_tokens"} }'
)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [OVERFLOW_SPACED, OVERFLOW_FLAT], ids=["nested", "flat"])
async def test_propagated_overflow_is_vllm_body_byte_for_byte(start_proxy, fake_vllm, path, stream, body):
    url = await start_proxy(propagate_context_overflow_errors=True)
    fake_vllm.push(Script(status=400, error_body=body))
    request = {"model": "m", "stream": stream}
    request.update({"input": "x"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "x"}]})
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=request) as reply:
            assert reply.status == 400
            assert reply.content_type == "application/json"
            assert await reply.read() == body


async def test_responses_length_finish_is_incomplete(client, fake_vllm):
    fake_vllm.push(Script(content="cut short", finish_reason="length"))
    response = await client.responses.create(model="m", input="x")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "cut short"


async def test_responses_non_overflow_400_is_passed_back(client, fake_vllm):
    fake_vllm.push(Script(status=400, error_message=TOO_MANY_OUTPUT))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="m", input="x", max_output_tokens=1000)
    assert caught.value.status_code == 400
    assert "cannot be greater than max_model_len" in caught.value.message


@pytest.mark.parametrize("status", [500, 503, 404])
async def test_upstream_errors_keep_status_and_message(client, fake_vllm, status):
    fake_vllm.push(Script(status=status, error_message=f"engine said {status}"))
    with pytest.raises(openai.APIStatusError) as caught:
        await client.responses.create(model="m", input="x")
    assert caught.value.status_code == status
    assert f"engine said {status}" in caught.value.message


async def test_upstream_error_without_json_body(client, fake_vllm):
    fake_vllm.push(Script(status=502, error_body=b"<html>bad gateway</html>"))
    status_error = openai.APIStatusError
    with pytest.raises(status_error) as caught:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 502
    assert "bad gateway" in caught.value.message


async def test_bad_requests_name_the_field(proxy_url):
    cases = [
        (b"{not json", None),
        (b"[1, 2]", None),
        (orjson.dumps({"model": "m", "input": "x", "top_k": 3}), "top_k"),
        (orjson.dumps({"model": "m", "input": [{"role": "user", "content": 5}]}), "input[0].content"),
        (orjson.dumps({"model": "m", "input": "x", "tool_choice": "required"}), "tool_choice"),
        (orjson.dumps({"model": "m", "input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
        (orjson.dumps({"model": "m", "input": [{"type": "web_search_call", "id": "w"}]}), "input[0].type"),
        (orjson.dumps({"model": "m", "input": "x", "stream": "yes"}), "stream"),
        (orjson.dumps({"model": "m", "input": "x", "metadata": {"a": 1}}), "metadata"),
    ]
    for raw, param in cases:
        status, body = await post(proxy_url, "/v1/responses", raw)
        assert status == 400, raw
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, (raw, error)
        assert "Traceback" not in error["message"]


async def test_body_over_the_limit_is_413(start_proxy):
    url = await start_proxy(max_body_size=2048)
    status, body = await post(url, "/v1/responses", {"model": "m", "input": "x" * 4096})
    assert status == 413
    assert "max_body_size" in body["error"]["message"]


async def test_default_body_limit_takes_large_rollouts(proxy_url, fake_vllm):
    image = "data:image/png;base64," + "A" * (3 * 1024 * 1024)
    item = {"role": "user", "content": [{"type": "input_image", "image_url": image}]}
    status, body = await post(proxy_url, "/v1/responses", {"model": "m", "input": [item]})
    assert status == 200, body
    assert fake_vllm.last_json()["messages"][0]["content"][0]["image_url"] == {"url": image, "detail": "auto"}


# --- /v1/chat/completions -----------------------------------------------------------------------


async def test_chat_passes_vllm_extras_both_ways(client, fake_vllm):
    completion = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1},
    )
    sent = fake_vllm.last_json()
    assert (sent["top_k"], sent["min_p"], sent["repetition_penalty"]) == (3, 0.1, 1.1)
    assert sent["model"] == "policy"
    assert completion.choices[0].message.content == "echo: hi"
    extras = completion.model_extra or {}
    assert "prompt_logprobs" in extras and "kv_transfer_params" in extras
    assert completion.choices[0].model_extra["stop_reason"] is None


async def test_chat_reasoning_folded_into_think_tags(client, fake_vllm):
    fake_vllm.push(Script(content="42", reasoning="add them"))
    completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "sum"}])
    message = completion.choices[0].message
    assert message.content == "<think>add them</think>42"
    assert "reasoning" not in (message.model_extra or {})


async def test_chat_reasoning_content_of_old_vllm_is_read(client, fake_vllm):
    fake_vllm.push(Script(content="42", reasoning="old style", reasoning_key="reasoning_content"))
    completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "sum"}])
    assert completion.choices[0].message.content == "<think>old style</think>42"


async def test_chat_without_parser_rejects_reasoning_replies(start_proxy, fake_vllm):
    url = await start_proxy(uses_reasoning_parser=False)
    fake_vllm.push(Script(content="42", reasoning="hidden"))
    status, body = await post(
        url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 502
    assert "uses_reasoning_parser" in body["error"]["message"]


async def test_chat_reply_bytes_pass_through_untouched(start_proxy, fake_vllm):
    url = await start_proxy(uses_reasoning_parser=False)
    fake_vllm.push(Script(content="plain", top_extra={"custom_field": {"nested": [1, 2]}}))
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ) as r:
            body = await r.read()
    assert b'"custom_field":{"nested":[1,2]}' in body
    assert b'"prompt_token_ids":null' in body


async def test_chat_context_overflow_is_a_length_finish(client, fake_vllm):
    completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "[[overflow]]"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None


async def test_chat_history_reasoning_split_and_strict_stripped(client, fake_vllm):
    await client.chat.completions.create(
        model="m",
        messages=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>a</think>x<think>b</think>y"},
            {"role": "user", "content": "more"},
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}],
    )
    sent = fake_vllm.last_json()
    assert sent["messages"][2] == {
        "role": "assistant",
        "content": "xy",
        "reasoning_content": "a\nb",
        "reasoning": "a\nb",
    }
    assert sent["messages"][0]["role"] == "developer"
    assert sent["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]


async def test_chat_invalid_requests(proxy_url):
    cases = [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [], "stream": "true"}, "stream"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"extra_body": "{oops"}},
            "metadata.extra_body",
        ),
    ]
    for body, param in cases:
        status, reply = await post(proxy_url, "/v1/chat/completions", body)
        assert status == 400, body
        assert reply["error"]["param"] == param, reply


async def test_sequential_reasoning_guard_answers_locally(start_proxy, fake_vllm):
    url = await start_proxy(sequential_reasoning_allowed=False, uses_reasoning_parser=True)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>only thoughts</think>"}]
    status, reply = await post(url, "/v1/chat/completions", {"model": "m", "messages": messages})
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "content_filter"
    assert [r.path for r in fake_vllm.requests if r.path != "/v1/models"] == []
    status, response = await post(
        url,
        "/v1/responses",
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
            ],
        },
    )
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "content_filter"}


# --- upstream failures ---------------------------------------------------------------------------


async def test_unreachable_upstream_is_502_naming_the_url(aiohttp_server, unused_tcp_port_factory):
    from gymproxy import build_config, create_app

    port = unused_tcp_port_factory()
    server = await aiohttp_server(create_app(build_config({"base_url": f"http://127.0.0.1:{port}/v1"})))
    status, body = await post(str(server.make_url("")).rstrip("/"), "/v1/responses", {"model": "m", "input": "x"})
    assert status == 502
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in body["error"]["message"]


async def test_silent_upstream_is_504(start_proxy, fake_vllm):
    url = await start_proxy(timeouts={"read": 0.3})
    fake_vllm.push(Script(hang=True))
    status, body = await post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 504
    assert fake_vllm.url + "/chat/completions" in body["error"]["message"]


async def test_client_disconnect_closes_the_upstream_request(proxy_url, fake_vllm):
    fake_vllm.push(Script(hang=True))
    async with aiohttp.ClientSession() as session:
        request = session.post(proxy_url + "/v1/responses", json={"model": "m", "input": "x"})
        task = asyncio.ensure_future(request)
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for _ in range(50):
        if fake_vllm.disconnects:
            break
        await asyncio.sleep(0.02)
    assert fake_vllm.disconnects, "the upstream never saw the client go away"


# --- other routes --------------------------------------------------------------------------------


async def test_models_health_tokenize_and_completions(client, proxy_url, fake_vllm):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy_url + "/health") as r:
            health = await r.json()
            assert r.status == 200 and health["status"] == "ok" and health["upstreams"][0]["healthy"] is True
        async with session.post(proxy_url + "/tokenize", json={"model": "m", "prompt": "a b c"}) as r:
            assert r.status == 200 and (await r.json())["count"] == 3
    completion = await client.completions.create(model="fake-model", prompt="one two", max_tokens=5)
    assert completion.choices[0].text
    assert fake_vllm.requests[-1].path == "/v1/completions"


async def test_upstream_gets_api_key_headers_and_query(start_proxy, fake_vllm):
    url = await start_proxy(
        api_key="sk-upstream", default_headers={"X-Team": "rl"}, default_query={"api-version": "2025-04-01"}
    )
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0) as c:
        await c.responses.create(model="m", input="x")
    seen = fake_vllm.requests[-1]
    assert seen.headers["Authorization"] == "Bearer sk-upstream"
    assert seen.headers["X-Team"] == "rl"
