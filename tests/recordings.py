"""The real vLLM traffic recorded in tests/data/vllm-0.32 (by tests/integration with GYMPROXY_RECORD=1):
loading a case, its event streams, and the (streamed, non-streamed) pairs of one /v1/responses case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from gymproxy.schemas.responses import ResponsesRequest
from gymproxy.sse import DONE, SSEDecoder

DATA = Path(__file__).parent / "data" / "vllm-0.32"
CASES = sorted(DATA.glob("*.json"))
RESPONSES_REQUEST = msgspec.json.Decoder(ResponsesRequest)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def events(body: str) -> list[Any]:
    """An SSE body as its decoded `data:` payloads (`[DONE]` kept as a string)."""
    decoder = SSEDecoder()
    out = []
    for payload in decoder.feed(body.encode()):
        out.append("[DONE]" if payload == DONE else json.loads(payload))
    return out


def responses_pairs() -> list[tuple[Path, Path]]:
    """(streamed, non-streamed) recordings of the same /v1/responses case."""
    pairs = []
    for stream in DATA.glob("*-stream*.json"):
        twin = stream.with_name(stream.name.replace("-stream", "-nostream"))
        if not twin.exists():
            continue
        step = load(twin)["steps"][0]
        if step["client"]["path"] == "/v1/responses" and step["client"]["status"] == 200 and chat_reply(step):
            pairs.append((stream, twin))
    return sorted(pairs)


def chat_reply(step: dict[str, Any]) -> dict[str, Any] | None:
    """The step's upstream chat exchange (status 200), if any."""
    for exchange in step["upstream"]:
        if exchange["path"] == "/v1/chat/completions" and exchange["status"] == 200:
            return exchange
    return None


PAIRS = responses_pairs()


def without_stream(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "stream"}


def items(response: Any) -> list[dict[str, Any]]:
    """What a Response says, without ids: item types, texts, reasoning, calls; status and usage."""
    out = []
    for item in msgspec.to_builtins(response.output):
        kept = {k: item[k] for k in ("type", "name", "arguments") if k in item}
        if item.get("content") is not None:
            kept["content"] = [part.get("text", part.get("refusal")) for part in item["content"]]
        if item.get("summary") is not None:
            kept["summary"] = [part["text"] for part in item["summary"]]
        out.append(kept)
    usage = msgspec.to_builtins(response.usage)
    return [response.status, usage, *out]
