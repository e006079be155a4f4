"""Training mode: the token ids and log-probs the policy produced, taken from a vLLM chat reply.

Sources, in NeMo Gym's order of preference (spec 9.3):
1. a message bundle (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs` on the
   assistant message, from a training framework's patched vLLM);
2. vLLM's inline ids: top-level `prompt_token_ids` with `choices[0].token_ids`, log-probs from
   `choices[0].logprobs.content`;
3. the `token_id:N` entries of `choices[0].logprobs.content`, with the prompt ids from `/tokenize`.
A reply whose sources are partial, malformed or disagree breaks the contract: `UpstreamError`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import BadRequest, UpstreamError

# The token fields of a training message or output item; clients echo them on history items.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
HISTORY_TOKEN_KEYS = frozenset((*TOKEN_FIELDS, "routed_experts"))
# What /tokenize is sent of a generation body: the fields that shape its prompt (spec 9.3, 10 step 9).
_TOKENIZE_CHAT = (
    "model",
    "messages",
    "tools",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "required_prefix_token_ids",
)
_TOKENIZE_PROMPT = ("model", "prompt", "add_special_tokens")


class TokenInfo(msgspec.Struct, kw_only=True):
    prompt_token_ids: list[int] | None  # None: still to be fetched from /tokenize
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any = None
    from_bundle: bool = False
    weight_version: str | None = None  # the engine's weight version(s) while it was sampled


def from_reply(reply: dict[str, Any]) -> TokenInfo:
    """Token information of choices[0]; `prompt_token_ids` is None when /tokenize must supply it."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamError("the upstream reply has no choices to take token ids from")
    choice = choices[0]
    found = choice.get("message")
    message: dict[str, Any] = found if isinstance(found, dict) else {}
    inline_prompt = reply.get("prompt_token_ids")
    inline_generation = choice.get("token_ids")
    present = [name for name in TOKEN_FIELDS if message.get(name) is not None]
    if present:
        missing = [name for name in TOKEN_FIELDS if message.get(name) is None]
        if missing:
            raise UpstreamError(f"choice.message returned partial token metadata; missing: {', '.join(missing)}.")
        info = TokenInfo(
            prompt_token_ids=token_ids(message["prompt_token_ids"], "prompt_token_ids"),
            generation_token_ids=token_ids(message["generation_token_ids"], "generation_token_ids"),
            generation_log_probs=_logprobs(message["generation_log_probs"], "generation_log_probs"),
            routed_experts=message.get("routed_experts"),
            from_bundle=True,
        )
        _same_length(info, "choice.message")
        if inline_prompt is not None and inline_generation is not None:
            if inline_prompt != info.prompt_token_ids or inline_generation != info.generation_token_ids:
                raise UpstreamError("Message-level token metadata disagrees with vLLM response token IDs.")
        return info
    if (inline_prompt is None) != (inline_generation is None):
        absent = "choice.token_ids" if inline_generation is None else "prompt_token_ids"
        raise UpstreamError(f"vLLM response returned partial token metadata; missing: {absent}.")
    logprob_ids, logprobs = from_logprobs(choice.get("logprobs"))
    if inline_generation is not None:
        generation = token_ids(inline_generation, "choice.token_ids")
        if generation != logprob_ids:
            raise UpstreamError("vLLM response generation token IDs disagree with choice logprob token IDs.")
        info = TokenInfo(
            prompt_token_ids=token_ids(inline_prompt, "prompt_token_ids"),
            generation_token_ids=generation,
            generation_log_probs=logprobs,
        )
    else:
        info = TokenInfo(prompt_token_ids=None, generation_token_ids=logprob_ids, generation_log_probs=logprobs)
    info.routed_experts = message.get("routed_experts")
    _same_length(info, "vLLM logprobs")
    return info


def from_logprobs(logprobs: Any) -> tuple[list[int], list[float]]:
    """Generated ids and log-probs from `logprobs.content` entries of the form `token_id:N`."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        raise UpstreamError(
            "gymproxy requested per-token logprobs from vLLM (return_token_id_information=True, logprobs=True, "
            f"top_logprobs=0), but the response had none (choice.logprobs={short(logprobs)}). "
            "Cannot extract token ids or logprobs."
        )
    ids: list[int] = []
    values: list[float] = []
    for index, entry in enumerate(content):
        if not isinstance(entry, dict):
            raise UpstreamError(f"choice.logprobs.content[{index}] must be an object.")
        token = entry.get("token")
        if not (isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit()):
            raise UpstreamError(f"choice.logprobs.content[{index}].token must use the `token_id:<int>` format.")
        logprob = entry.get("logprob")
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            raise UpstreamError(f"choice.logprobs.content[{index}].logprob must be numeric.")
        ids.append(int(token[9:]))
        values.append(float(logprob))
    return ids, values


def tokenize_body(body: dict[str, Any]) -> dict[str, Any]:
    """The /tokenize request for a generation body (chat `messages` or a completions `prompt`):
    the fields that shape its prompt."""
    fields = _TOKENIZE_CHAT if "messages" in body else _TOKENIZE_PROMPT
    return {name: body[name] for name in fields if name in body}


def require_one_choice(body: dict[str, Any]) -> None:
    """Training mode returns the token ids of one generation: `n` must be absent or 1."""
    if body.get("n") not in (None, 1):
        raise BadRequest("n must be 1 when gymproxy returns token ids for training", param="n")


def prompt_ids_from_tokenize(reply: Any) -> list[int]:
    tokens = reply.get("tokens") if isinstance(reply, dict) else None
    if not isinstance(tokens, list):
        raise UpstreamError("the upstream's /tokenize reply has no `tokens` list")
    return token_ids(tokens, "tokens")


def attach_to_chat(reply: dict[str, Any], info: TokenInfo) -> None:
    """The chat reply as training clients get it: the token fields on the message (spec 9.3)."""
    reply.pop("prompt_token_ids", None)
    choice = reply["choices"][0]
    choice.pop("token_ids", None)
    if not info.from_bundle:
        choice["logprobs"] = None
    message = choice.setdefault("message", {})
    message["prompt_token_ids"] = info.prompt_token_ids
    message["generation_token_ids"] = info.generation_token_ids
    message["generation_log_probs"] = info.generation_log_probs
    message["routed_experts"] = info.routed_experts


def token_ids(value: Any, name: str) -> list[int]:
    """`value` as a list of integer token ids; anything else breaks the upstream's contract."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise UpstreamError(f"`{name}` must be a list of integer token IDs.")
    return value


def _logprobs(value: Any, name: str) -> list[float]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise UpstreamError(f"`{name}` must be a list of numeric log probabilities.")
    return [float(v) for v in value]


def _same_length(info: TokenInfo, source: str) -> None:
    if len(info.generation_token_ids) != len(info.generation_log_probs):
        raise UpstreamError(
            f"{source} returned mismatched generation token IDs and log probabilities: "
            f"{len(info.generation_token_ids)} token IDs and {len(info.generation_log_probs)} log probabilities."
        )


def short(value: Any) -> str:
    """A repr for an error message, cut at 200 characters."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
