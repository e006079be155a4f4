"""A stream a weight-update pause cut (`finish_reason: "abort"`), continued as a partial rollout.

vLLM's `abort` pause ends every generation at once. A stream already under way cannot be taken back,
so with fleet control on gymproxy continues it once the engine resumes: the same chat request, with
what was generated so far as a final assistant message that vLLM continues
(`continue_final_message`), its token budget less what was used (exact when the stream carried its
usage; else counted by deltas, which a few tokens share, so the whole may run a few tokens over
`max_tokens`). The client sees one stream. Its
text was sampled by two policies (the old weights before the pause, the new ones after), as in the
partial rollouts of asynchronous RL; `X-Weight-Version` and the token fields say so.

Only text is continued: a cut tool call (its arguments are not valid JSON yet) or a reasoning block
still open is not, and the stream ends saying it was aborted.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Partial(NamedTuple):
    """What a cut stream generated: its answer text, and its (finished) reasoning."""

    content: str
    reasoning: str
    tokens: int | None  # tokens generated: its usage when the stream had it, else its deltas (a few less)


def continuation(body: dict[str, Any], partial: Partial) -> dict[str, Any] | None:
    """The chat body that continues `body` after `partial`; None when it cannot be continued
    (several choices asked for, or nothing left of the token budget)."""
    if body.get("n") not in (None, 1):
        return None
    messages = list(body.get("messages") or ())
    last = messages[-1] if messages else None
    if body.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant":
        if not isinstance(last.get("content"), str) or partial.reasoning:
            return None  # content parts, or reasoning on a continued turn: not rebuilt here
        messages[-1] = {**last, "content": last["content"] + partial.content}
    else:
        message: dict[str, Any] = {"role": "assistant", "content": partial.content}
        if partial.reasoning:
            message["reasoning"] = message["reasoning_content"] = partial.reasoning
        messages.append(message)
    out = {**body, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    if partial.tokens:
        for key in ("max_tokens", "max_completion_tokens"):
            budget = out.get(key)
            if type(budget) is int:
                if budget - partial.tokens < 1:
                    return None
                out[key] = budget - partial.tokens
    return out
