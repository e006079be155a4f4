"""Chat templates for the completions backend: a Hugging Face tokenizer loaded once at startup.

Loading is I/O (the hub or a local directory) and can run a model's own code, so it happens here,
outside the pure `convert/` package, and runs remote code only with `trust_remote_code: true`.
Rendering is blocking Jinja work: callers run `render` in a thread.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError
from .convert.completions import check_text_only
from .errors import BadRequest

# apply_chat_template arguments gymproxy sets itself: chat_template_kwargs may not replace them.
_RESERVED_KWARGS = frozenset({"conversation", "tools", "tokenize", "add_generation_prompt"})
_INSTALL = "pip install 'gymproxy[template]'"


class ChatTemplate:
    """A tokenizer's chat template, rendering a chat request's messages to one prompt."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self._refusals = _template_refusals()

    @classmethod
    def load(cls, name_or_path: str, *, trust_remote_code: bool = False) -> ChatTemplate:
        """Load the tokenizer (`tokenizer:` or else `model:` from the config); raises ConfigError."""
        try:
            import jinja2  # noqa: F401  (transformers renders templates with it but does not require it)
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError(
                f"config: `render_chat_template: true` needs the `transformers` and `jinja2` packages "
                f"({exc}); install them with: {_INSTALL}"
            ) from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # hub, filesystem and tokenizer-format errors alike
            hint = "" if trust_remote_code else " (a tokenizer that ships its own code needs `trust_remote_code: true`)"
            raise ConfigError(
                f"config: cannot load the tokenizer {name_or_path!r} for render_chat_template: {exc}{hint}. "
                "Set `tokenizer:` to a Hugging Face id or a local directory, or set render_chat_template: false."
            ) from exc
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"config: the tokenizer loaded from {name_or_path!r} has no chat template; point `tokenizer:` "
                "at a model whose tokenizer ships one, or set render_chat_template: false."
            )
        return cls(tokenizer, name_or_path)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]) -> str:
        """The prompt for `messages`, ending where the assistant turn begins. Blocking: run it in a thread."""
        check_text_only(messages)
        reserved = sorted(_RESERVED_KWARGS.intersection(kwargs))
        if reserved:
            raise BadRequest(
                f"chat_template_kwargs may not set {reserved}: gymproxy sets them itself", param="chat_template_kwargs"
            )
        # Text parts become one string, as vLLM does before it renders: templates concatenate content.
        messages = [
            {**m, "content": "".join(p.get("text") or "" for p in m["content"])}
            if isinstance(m.get("content"), list)
            else m
            for m in messages
        ]
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, tools=tools or None, **kwargs
            )
        except self._refusals as exc:
            # The template refused these messages (e.g. `raise_exception("roles must alternate")`).
            raise BadRequest(
                f"the chat template of {self.name!r} cannot render this request: {exc}", param="messages"
            ) from exc
        if not isinstance(prompt, str):
            raise BadRequest(
                "chat_template_kwargs made the chat template return something other than text",
                param="chat_template_kwargs",
            )
        return prompt


def _template_refusals() -> tuple[type[Exception], ...]:
    """What a chat template raises when it cannot render a request (as opposed to a gymproxy bug)."""
    refusals: tuple[type[Exception], ...] = (TypeError, ValueError, KeyError)
    try:
        from jinja2 import TemplateError
    except ImportError:
        return refusals
    return (TemplateError, *refusals)
