"""A stream a pause cut, continued (`convert.continuation`): the chat body that picks it up."""

from __future__ import annotations

from gymproxy.convert.continuation import Partial, continuation

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 100}


def test_the_text_so_far_becomes_the_final_assistant_message_vllm_continues():
    body = continuation(BODY, Partial("Hello, wo", "", 4))
    assert body is not None
    assert body["messages"] == [*BODY["messages"], {"role": "assistant", "content": "Hello, wo"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 96 and BODY["max_tokens"] == 100  # the budget less what was used; BODY untouched


def test_finished_reasoning_goes_with_it():
    body = continuation(BODY, Partial("The answer", "I thought", 5))
    assert body is not None
    last = body["messages"][-1]
    assert last["reasoning"] == last["reasoning_content"] == "I thought" and last["content"] == "The answer"


def test_a_turn_that_was_already_continued_grows_in_place():
    given = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Once"}]}
    body = continuation({**given, "continue_final_message": True}, Partial(" upon", "", 1))
    assert body is not None and body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert len(body["messages"]) == 2


def test_what_cannot_be_continued_is_not():
    assert continuation({**BODY, "n": 2}, Partial("a", "", 1)) is None  # several choices
    assert continuation(BODY, Partial("a" * 100, "", 100)) is None  # nothing left of the budget
    no_budget = {k: v for k, v in BODY.items() if k != "max_tokens"}
    assert continuation(no_budget, Partial("a", "", 50)) is not None  # no budget given: none to spend
