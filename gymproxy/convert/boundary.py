"""The vLLM boundary (spec section 6): the last rewrite of every chat body before it goes upstream.

Both `/v1/chat/completions` and the Responses conversion end here. The body is a mapping owned by
the request (decoded from the client's bytes or built by `request.py`), so it is rewritten in place
and nothing is deep-copied; messages are replaced only where a rule changes them. The Responses
route applies the rules for history messages (role, reasoning split) while it builds them, through
`role` and `split_turn`, so its messages are made once instead of made and then rewritten.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec
import orjson

from ..errors import AnswerLocally, BadRequest
from .tokens import HISTORY_TOKEN_KEYS, require_one_choice

log = logging.getLogger("gymproxy")

OPEN, CLOSE = "<think>", "</think>"


class Rules(msgspec.Struct, frozen=True, kw_only=True):
    """One config's boundary rules (the `Config` keys of the same names), made once at startup."""

    model: str | None = None
    uses_reasoning_parser: bool = False
    uses_interleaved_reasoning: bool = True
    reasoning_field: Literal["both", "reasoning", "reasoning_content"] = "both"
    preserve_reasoning_in_assistant_content: bool = False
    replace_developer_role_with_system: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    forward_request_chat_template_kwargs: bool = False
    extra_body: dict[str, Any] | None = None
    continue_final_assistant_message: bool = False
    return_token_id_information: bool = False
    request_prompt_and_generation_token_ids: bool = False
    sampling_overrides: dict[str, Any] | None = None
    sequential_reasoning_allowed: bool = True


def split_think(text: str) -> tuple[list[str], str]:
    """All `<think>...</think>` blocks in order, and the text with them removed.

    The same as the non-greedy regex `<think>(.*?)</think>` (DOTALL) with findall and sub, in one
    pass of `str.find`: a block ends at the first `</think>` after its `<think>`; an unclosed
    `<think>` and a stray `</think>` stay text.
    """
    start = text.find(OPEN)
    if start < 0:
        return [], text
    found: list[str] = []
    kept: list[str] = []
    done = 0
    while start >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        kept.append(text[done:start])
        found.append(text[start + len(OPEN) : end])
        done = end + len(CLOSE)
        start = text.find(OPEN, done)
    kept.append(text[done:])
    return found, "".join(kept)


CONTROL_KEYS = ("chat_template_kwargs", "extra_body")

_REASONING_KEYS = {
    "both": ("reasoning_content", "reasoning"),
    "reasoning": ("reasoning",),
    "reasoning_content": ("reasoning_content",),
}


class Boundary:
    """Applies one config's boundary rules; holds the only mutable state (a warn-once flag)."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.reasoning_keys = _REASONING_KEYS[rules.reasoning_field] if rules.uses_interleaved_reasoning else ()
        self.split_history = rules.uses_reasoning_parser and not rules.preserve_reasoning_in_assistant_content
        self.developer_as_system = rules.replace_developer_role_with_system
        self._warned_template_kwargs = False

    def prepare(self, body: dict[str, Any], *, built: bool = False) -> dict[str, Any]:
        """Rewrite `body` for vLLM; returns the body to send (a new mapping only when extra_body applies).

        `built`: the body comes from `to_chat_body(req, self)`, whose messages were made with `role`
        and `split_turn` (and carry no token metadata) and whose tools have no `strict`, so the
        per-message and per-tool rules are skipped. Raises `AnswerLocally` when the sequential-
        reasoning guard answers without asking vLLM (spec 7.3).
        """
        rules = self.rules
        messages: list[dict[str, Any]] = body["messages"]
        tools = body.get("tools")
        if tools and not built:
            body["tools"] = [without_strict(tool) for tool in tools]
        if rules.model is not None:
            body["model"] = rules.model

        metadata = body.get("metadata")
        controls = pop_controls(body, metadata) if metadata else {}
        template_kwargs = dict(rules.chat_template_kwargs or {})
        requested = body.pop("chat_template_kwargs", None)
        if requested:
            if rules.forward_request_chat_template_kwargs:
                template_kwargs.update(requested)
            else:
                self.warn_dropped_template_kwargs("forward_request_chat_template_kwargs is false")
        template_kwargs.update(controls.get("chat_template_kwargs", {}))
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        extra_body = {**(rules.extra_body or {}), **controls.get("extra_body", {})}

        if rules.continue_final_assistant_message and messages and messages[-1].get("role") == "assistant":
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        if rules.return_token_id_information:
            body["logprobs"] = True
            body["top_logprobs"] = 0
            body["return_tokens_as_token_ids"] = True
            if rules.request_prompt_and_generation_token_ids:
                body["return_token_ids"] = True
        if not built:
            body["messages"] = self._history(messages)
        if "top_logprobs" in body and body["top_logprobs"] is None:
            del body["top_logprobs"]  # vLLM reads a null top_logprobs as "no logprobs"
        if extra_body:
            body = {**extra_body, **body}
        if rules.sampling_overrides:
            body.update(rules.sampling_overrides)
        if rules.return_token_id_information:
            require_one_choice(body)
        if not rules.sequential_reasoning_allowed and sequential_reasoning_blocked(body):
            raise AnswerLocally("content_filter", "a trailing empty assistant turn is answered locally")
        return body

    def _history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The per-message rules: developer role, token metadata, reasoning split."""
        if self.developer_as_system:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        if not all(HISTORY_TOKEN_KEYS.isdisjoint(m) for m in messages):
            # A training client's token metadata on history turns: vLLM does not read it.
            messages = [{k: v for k, v in m.items() if k not in HISTORY_TOKEN_KEYS} for m in messages]
        if self.split_history:
            messages = [self._split(m, i) if m.get("role") == "assistant" else m for i, m in enumerate(messages)]
        return messages

    def role(self, role: str) -> str:
        """A message's role as vLLM gets it."""
        return "system" if role == "developer" and self.developer_as_system else role

    def split_turn(self, message: dict[str, Any], thoughts: list[str], said: list[str]) -> None:
        """Split an assistant message `to_chat_body` builds, in place, as `prepare` would.

        Its content is the turn's reasoning summaries (`thoughts`), each wrapped as
        `<think>...</think>`, and its texts (`said`), in order. When the only `think>` in it are
        the wrappers', the split is known without a scan: any other `<think>` or `</think>`, even
        one formed where two texts meet, would add a `think>` (which cannot overlap itself).
        """
        content = message["content"]
        if not content or not self.split_history:
            return
        if content.count("think>") == 2 * len(thoughts):
            found, message["content"] = thoughts, "".join(said)
        else:
            found, message["content"] = split_think(content)
        if found:
            self._add_reasoning(message, found)

    def warn_dropped_template_kwargs(self, why: str) -> None:
        """Say once per process that requests' own chat_template_kwargs are dropped, and why."""
        if not self._warned_template_kwargs:
            self._warned_template_kwargs = True
            log.warning(
                "dropping the request's top-level chat_template_kwargs (%s); use metadata.chat_template_kwargs", why
            )

    def _split(self, message: dict[str, Any], index: int) -> dict[str, Any]:
        """Move `<think>` blocks of an assistant history turn into the reasoning field(s)."""
        content = message.get("content")
        if not content:
            return message
        found: list[str] = []
        if isinstance(content, str):
            found, content = split_think(content)
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    raise BadRequest(
                        "assistant content parts must carry `text` when gymproxy splits reasoning out of history",
                        param=f"messages[{index}].content[{j}]",
                    )
                thoughts, text = split_think(text)
                found += thoughts
                parts.append({**part, "text": text})
            content = parts
        else:
            raise BadRequest(
                "assistant content must be a string or a list of parts", param=f"messages[{index}].content"
            )
        message = {**message, "content": content}
        if found:
            self._add_reasoning(message, found)
        return message

    def _add_reasoning(self, message: dict[str, Any], found: list[str]) -> None:
        if self.reasoning_keys:
            # All blocks are kept (NeMo Gym sends only the first).
            reasoning = "\n".join(found)
            for key in self.reasoning_keys:
                message[key] = reasoning


def without_strict(tool: Any) -> Any:
    """vLLM rejects or mishandles `strict` on function tools; custom tools are left alone."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        function = tool.get("function")
        if isinstance(function, dict) and "strict" in function:
            return {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
    return tool


def read_controls(metadata: dict[str, Any] | None, keys: tuple[str, ...] = CONTROL_KEYS) -> dict[str, dict[str, Any]]:
    """`metadata.chat_template_kwargs` / `metadata.extra_body` (or just `keys`), each a JSON object
    encoded as a string; the one reader of both, on every path."""
    controls = {}
    for key in keys:
        raw = metadata.get(key) if metadata else None
        if raw is None:
            continue
        try:
            value = orjson.loads(raw) if raw else {}
        except (orjson.JSONDecodeError, TypeError):
            raise BadRequest(
                f"metadata.{key} must be a JSON object encoded as a string", param=f"metadata.{key}"
            ) from None
        if not isinstance(value, dict):
            raise BadRequest(f"metadata.{key} must decode to a JSON object", param=f"metadata.{key}")
        controls[key] = value
    return controls


def pop_controls(body: dict[str, Any], metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`read_controls`, then remove those keys from the metadata sent upstream (and an emptied metadata)."""
    if not any(key in metadata for key in CONTROL_KEYS):
        return {}
    controls = read_controls(metadata)
    rest = {k: v for k, v in metadata.items() if k not in CONTROL_KEYS}
    if rest:
        body["metadata"] = rest
    else:
        del body["metadata"]
    return controls


def sequential_reasoning_blocked(body: dict[str, Any]) -> bool:
    """`sequential_reasoning_allowed: false`: a trailing empty assistant turn is answered locally."""
    messages = body.get("messages") or ()
    if not messages:
        return False
    last = messages[-1]
    return last.get("role") == "assistant" and not last.get("content") and not last.get("tool_calls")
