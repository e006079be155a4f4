"""The `/v1/completions` backend (`use_completions_api: true`, spec section 10), as pure functions.

The client still speaks chat; gymproxy renders the messages to one prompt string, sends vLLM a
text-completion body, and wraps the answer (or each streamed `text_completion` chunk) back into
chat form. The order the exchange follows:

    dropped = check_chat_body(body, rendered=rules.render_chat_template)   # steps 1-4; may raise BadRequest
    prompt = render_raw(body["messages"])              # or, with render_chat_template (templates.py):
    prompt = template.render(body["messages"], body.get("tools"), template_kwargs(rules.chat_template_kwargs, metadata))
    completion_body = to_completions_body(body, rules, prompt)
    ... POST /v1/completions ...
    chat = to_chat_completion(reply, rules.model, training=rules.return_token_id_information)
    # training mode with no prompt ids from vLLM: POST /tokenize with tokens.tokenize_body(completion_body)

None of §6 (the chat boundary) applies on this path.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..errors import BadRequest, UpstreamError
from ..ids import hex32
from .boundary import read_controls, without_strict
from .tokens import require_one_choice, short, token_ids


class Rules(msgspec.Struct, frozen=True, kw_only=True):
    """One config's completions-backend rules (the `Config` keys of the same names)."""

    model: str | None = None
    render_chat_template: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None
    sampling_overrides: dict[str, Any] | None = None
    return_token_id_information: bool = False


# Chat request fields /v1/completions takes under the same name (spec 10 step 6).
PASSED_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "response_format",
    "user",
)
AUDIO_KEYS = ("audio_data", "audio_path", "audio_paths")
TEXT_PARTS = ("text", "input_text")
TOKEN_PREFIX = "token_id:"


# --- prompt rendering ------------------------------------------------------------------------


def render_raw(messages: list[dict[str, Any]]) -> str:
    """Raw mode: `[user]` or `[system, user]`, text only, joined with a blank line (spec 10 step 5)."""
    if not messages:
        raise BadRequest("Cannot render an empty messages list to a prompt.", param="messages")
    if len(messages) > 2:
        raise BadRequest(
            "use_completions_api=true accepts at most one system + one user message; "
            f"got {len(messages)} messages. Render the prompt upstream and submit a single user message "
            "(or set render_chat_template: true).",
            param="messages",
        )
    roles = [_role(m) for m in messages]
    if len(messages) == 2 and roles != ["system", "user"]:
        where = 0 if roles[0] != "system" else 1
        raise BadRequest(
            f"use_completions_api=true requires the two-message form to be [system, user]; got {roles}.",
            param=f"messages[{where}].role",
        )
    if len(messages) == 1 and roles[0] != "user":
        raise BadRequest(
            f"use_completions_api=true requires a user message; got role={roles[0]!r}.",
            param="messages[0].role",
        )
    return "\n\n".join(_flatten(m, i) for i, m in enumerate(messages))


def check_text_only(messages: list[dict[str, Any]]) -> None:
    """Chat-template mode: every non-null content must be a string or a list of text parts."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest("a message must be an object", param=f"messages[{index}]")
        if message.get("content") is not None:
            _flatten(message, index)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _flatten(message: Any, index: int) -> str:
    """A message's content as one string: a string as is, text parts concatenated."""
    if not isinstance(message, dict):
        raise BadRequest("a message must be an object", param=f"messages[{index}]")
    content = message.get("content")
    role = message.get("role")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(
            "use_completions_api=true requires string or text-block-list content; "
            f"got {'null' if content is None else type(content).__name__} for role={role!r}.",
            param=f"messages[{index}].content",
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(part, dict) or kind not in TEXT_PARTS:
            raise BadRequest(
                "use_completions_api=true only accepts text content blocks (/v1/completions is text-only); "
                f"got block type {kind!r} for role={role!r}.",
                param=f"messages[{index}].content[{j}]",
            )
        text = part.get("text", "")
        if not isinstance(text, str):
            raise BadRequest(
                "a text content block's `text` must be a string", param=f"messages[{index}].content[{j}].text"
            )
        texts.append(text)
    return "".join(texts)


def template_kwargs(base: dict[str, Any] | None, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """Config `chat_template_kwargs` overlaid by the JSON object in `metadata.chat_template_kwargs`."""
    kwargs = dict(base or {})
    requested = read_controls(metadata, ("chat_template_kwargs",)).get("chat_template_kwargs")
    if requested:
        if "chat_template" in requested:
            # vLLM too refuses a request's own template unless the operator trusts it.
            param = "metadata.chat_template_kwargs"
            raise BadRequest(f"{param} may not replace the chat template", param=param)
        kwargs.update(requested)
    return kwargs


# --- request ---------------------------------------------------------------------------------


def check_chat_body(chat_body: dict[str, Any], *, rendered: bool) -> bool:
    """Spec 10 steps 1-4, in place: strip `strict`, drop the request's `chat_template_kwargs`,
    refuse tools in raw mode and audio metadata. Returns whether a non-empty
    `chat_template_kwargs` was dropped (the caller warns once per process)."""
    tools = chat_body.get("tools")
    if tools:
        chat_body["tools"] = [without_strict(tool) for tool in tools]
    dropped = bool(chat_body.pop("chat_template_kwargs", None))
    if tools and not rendered:
        raise BadRequest(
            "tools are not supported with use_completions_api=true and render_chat_template=false; "
            "set render_chat_template: true (the chat template renders tool definitions into the prompt) "
            "or use_completions_api: false for the chat tool-call path.",
            param="tools",
        )
    metadata = chat_body.get("metadata") or {}
    for key in AUDIO_KEYS:
        if metadata.get(key):
            raise BadRequest(
                f"audio metadata ({key!r}) is not supported with use_completions_api=true. /v1/completions is text-only.",
                param=f"metadata.{key}",
            )
    return dropped


def to_completions_body(chat_body: dict[str, Any], rules: Rules, prompt: str) -> dict[str, Any]:
    """The /v1/completions body for a chat request whose messages rendered to `prompt` (spec 10 steps 6-7)."""
    training = rules.return_token_id_information
    # Without a configured model the client's stands, as on the chat path.
    model = rules.model if rules.model is not None else chat_body.get("model")
    body: dict[str, Any] = {"model": model, "prompt": prompt}
    for key in PASSED_FIELDS:
        if key in chat_body:
            body[key] = chat_body[key]
    if "max_tokens" not in body and "max_completion_tokens" in chat_body:
        body["max_tokens"] = chat_body["max_completion_tokens"]
    # /v1/completions' `logprobs` is the top-N count; 0 asks for the sampled token only.
    if chat_body.get("top_logprobs") is not None:
        body["logprobs"] = chat_body["top_logprobs"]
    elif chat_body.get("logprobs") is True or training:
        body["logprobs"] = 0
    if rules.extra_body:
        body = {**rules.extra_body, **body}  # the request wins; metadata.extra_body is not read here
    if training:
        body["return_token_ids"] = True
        body["return_tokens_as_token_ids"] = True
    if rules.sampling_overrides:
        body.update(rules.sampling_overrides)
    # The transport is gymproxy's choice, whatever extra_body or sampling_overrides say.
    body.pop("stream", None)
    body.pop("stream_options", None)
    if chat_body.get("stream") is True:
        options = chat_body.get("stream_options")
        body["stream"] = True
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if training:
        require_one_choice(body)
    return body


# --- reply -----------------------------------------------------------------------------------


def to_chat_completion(reply: dict[str, Any], model: str | None, *, training: bool) -> dict[str, Any]:
    """A /v1/completions reply as a `chat.completion` (spec 10 step 10); `choices[0]` only.

    In training mode the message carries the token fields; `prompt_token_ids` is None when vLLM
    did not return them and the caller must fill them from /tokenize.
    """
    choice = _first_choice(reply)
    message: dict[str, Any] = {"role": "assistant", "content": _text(choice), "tool_calls": None}
    logprobs = None
    if training:
        message.update(token_fields(choice))
        message["routed_experts"] = None
    else:
        logprobs = chat_logprobs(choice.get("logprobs"))
    upstream_id = reply.get("id")
    return {
        "id": upstream_id if isinstance(upstream_id, str) and upstream_id else f"chatcmpl-{hex32()}",
        "object": "chat.completion",
        "created": reply.get("created") or int(time.time()),
        "model": reply.get("model") or model,
        "choices": [
            {
                "index": choice.get("index", 0),
                "finish_reason": choice.get("finish_reason") or "stop",
                "message": message,
                "logprobs": logprobs,
            }
        ],
        "usage": reply.get("usage"),
    }


def token_fields(choice: dict[str, Any]) -> dict[str, Any]:
    """Training-mode token fields of one completion choice; UpstreamError when vLLM broke the contract.

    Generated ids come from `choice.token_ids`, else from `logprobs.tokens` (`token_id:N`);
    log-probs from `logprobs.token_logprobs`; prompt ids from `choice.prompt_token_ids` (may be None).
    """
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or logprobs.get("token_logprobs") is None:
        raise UpstreamError(
            "gymproxy requested per-token logprobs from vLLM (return_token_id_information=True, logprobs=0), "
            f"but the response had none (choice.logprobs={short(logprobs)}). Cannot extract token IDs or logprobs."
        )
    ids = choice.get("token_ids")
    if ids is not None:
        generation = token_ids(ids, "choice.token_ids")
    elif logprobs.get("tokens") is not None:
        tokens = logprobs["tokens"]
        if not isinstance(tokens, list):
            raise UpstreamError("`choice.logprobs.tokens` must be a list")
        generation = [_token_id(token, i) for i, token in enumerate(tokens)]
    else:
        raise UpstreamError(
            "gymproxy requested generation token IDs from vLLM, but the response contained neither "
            "choice.token_ids nor choice.logprobs.tokens."
        )
    values = logprobs["token_logprobs"]
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise UpstreamError("`choice.logprobs.token_logprobs` must be a list of numeric log probabilities.")
    if len(values) != len(generation):
        raise UpstreamError(
            f"vLLM returned mismatched generation token IDs and log probabilities: "
            f"{len(generation)} token IDs and {len(values)} log probabilities."
        )
    prompt = choice.get("prompt_token_ids")
    return {
        "prompt_token_ids": None if prompt is None else token_ids(prompt, "choice.prompt_token_ids"),
        "generation_token_ids": generation,
        "generation_log_probs": [float(v) for v in values],
    }


def chat_logprobs(logprobs: Any) -> dict[str, Any] | None:
    """Completion-style logprobs (parallel lists) as chat-style `{"content": [entry, ...]}`."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise UpstreamError("the upstream's logprobs must hold as many `token_logprobs` as `tokens`")
    content = []
    for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append(
            {
                "token": token,
                "logprob": value,
                "bytes": None,
                "top_logprobs": [{"token": t, "logprob": v, "bytes": None} for t, v in top.items()],
            }
        )
    return {"content": content}


class CompletionChunks:
    """Streamed `text_completion` chunks in, `chat.completion.chunk` dicts out, one for one.

    The first output of each choice also carries `delta.role`; the prompt ids vLLM puts on a
    completion choice go top-level, where vLLM's chat stream has them. vLLM's in-stream
    `{"error": ...}` passes through untouched. `token_fields()` gives the training-mode token
    fields of choice 0 once the stream is over, by the same rules as `to_chat_completion`.
    """

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._id = f"chatcmpl-{hex32()}"
        self._created = int(time.time())
        self._started: set[int] = set()
        # Choice 0, accumulated for token_fields().
        self._prompt_ids: Any = None
        self._token_ids: list[Any] | None = None
        self._tokens: list[Any] = []
        self._values: list[Any] = []
        self._had_logprobs = False

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Translate one decoded upstream chunk."""
        if chunk.get("error") is not None:
            return chunk
        upstream_id = chunk.get("id")
        out: dict[str, Any] = {
            "id": upstream_id if isinstance(upstream_id, str) and upstream_id else self._id,
            "object": "chat.completion.chunk",
            "created": chunk.get("created") or self._created,
            "model": chunk.get("model") or self.model,
            "choices": [],
        }
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise UpstreamError("a streamed completion chunk's `choices` must be a list")
        prompt_ids = None
        for choice in choices:
            if not isinstance(choice, dict):
                raise UpstreamError("a streamed completion choice must be an object")
            index = choice.get("index", 0)
            text = _text(choice)
            delta: dict[str, Any] = {}
            if index not in self._started:
                self._started.add(index)
                delta["role"] = "assistant"
                delta["content"] = text
            elif text:
                delta["content"] = text
            converted: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(choice.get("logprobs")),
                "finish_reason": choice.get("finish_reason"),
            }
            if choice.get("token_ids") is not None:
                converted["token_ids"] = choice["token_ids"]
            if prompt_ids is None:
                prompt_ids = choice.get("prompt_token_ids")
            if index == 0:
                self._collect(choice)
            out["choices"].append(converted)
        if prompt_ids is not None:
            out["prompt_token_ids"] = prompt_ids
        if "usage" in chunk:
            out["usage"] = chunk["usage"]
        return out

    def token_fields(self) -> dict[str, Any]:
        """Choice 0's prompt ids (None: ask /tokenize), generated ids and log-probs."""
        choice: dict[str, Any] = {"prompt_token_ids": self._prompt_ids, "token_ids": self._token_ids}
        if self._had_logprobs:
            choice["logprobs"] = {"tokens": self._tokens, "token_logprobs": self._values}
        return token_fields(choice)

    def _collect(self, choice: dict[str, Any]) -> None:
        if choice.get("prompt_token_ids") is not None and self._prompt_ids is None:
            self._prompt_ids = choice["prompt_token_ids"]
        ids = choice.get("token_ids")
        if ids is not None:
            if not isinstance(ids, list):
                raise UpstreamError("`choice.token_ids` must be a list of integer token IDs.")
            self._token_ids = (self._token_ids or []) + ids
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("token_logprobs") is not None:
            self._had_logprobs = True
            self._tokens += logprobs.get("tokens") or []
            self._values += logprobs["token_logprobs"]


# --- helpers ---------------------------------------------------------------------------------


def _first_choice(reply: Any) -> dict[str, Any]:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamError("the upstream's /v1/completions reply has no choices")
    return choices[0]


def _text(choice: dict[str, Any]) -> str:
    text = choice.get("text")
    if text is None:
        return ""
    if not isinstance(text, str):
        raise UpstreamError("a completion choice's `text` must be a string")
    return text


def _token_id(token: Any, index: int) -> int:
    """`token_id:N` (vLLM's return_tokens_as_token_ids form) as N."""
    digits = token.removeprefix(TOKEN_PREFIX) if isinstance(token, str) else ""
    if not (digits.isascii() and digits.isdigit()):
        raise UpstreamError(f"choice.logprobs.tokens[{index}] must use the `token_id:<int>` format.")
    return int(digits)
