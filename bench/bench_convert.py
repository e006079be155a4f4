"""Micro-benchmark of gymproxy's conversion path, in microseconds per operation, without any I/O.

Request:  bytes -> decode -> to_chat_body (with the boundary's rules) -> Boundary.prepare -> encode -> bytes
Reply:    bytes -> decode -> to_response -> encode -> bytes (client)
Streams:  per upstream chunk: SSE decode -> chunk decode -> ResponsesStream.feed (or the chat
          route's reasoning fold) -> frames

Payloads come from bench/data/ (see make_data.py). Every figure is the median over `--repeat`
timed batches; a stage that rewrites its input in place gets a fresh input per call, made
outside the timed loop. Time is this process's CPU time (`time.process_time`), so other
processes on a busy machine do not leak into it. The garbage collector stays on, as in the server.

    python bench/bench_convert.py [--quick] [--format text|markdown|csv|json] [--min-time 0.2] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import options
import orjson
from formats import Column, Table, csv_text, markdown
from progress import Progress

from gymproxy import build_config
from gymproxy.convert.boundary import Boundary, Rules
from gymproxy.convert.reply import to_response
from gymproxy.convert.request import to_chat_body
from gymproxy.convert.stream import ChatReasoningFolder, ResponsesStream
from gymproxy.proxy import rules
from gymproxy.schemas import ENCODER
from gymproxy.schemas.chat import CHUNK_DECODER, COMPLETION_DECODER, ChatRequestView
from gymproxy.schemas.responses import REQUEST_DECODER
from gymproxy.sse import DONE, SSEDecoder

DATA = Path(__file__).resolve().parent / "data"
MODEL = "Qwen/Qwen3-8B"


class Stat(NamedTuple):
    """Microseconds per operation: the median batch, and the fastest one (how noisy it was)."""

    median: float
    best: float

    def __truediv__(self, n: float) -> Stat:
        return Stat(self.median / n, self.best / n)


CHUNK = 1000  # fresh inputs alive at once: many more and the collector walks them all, inside the timing


class Timer:
    """Times one operation: calibrates a batch size, then takes the median of `repeat` batches.

    A batch takes about `min_time` seconds of CPU, counting the making of fresh inputs: an
    operation that needs a fresh input costing 60 times more than itself (`Boundary.prepare` on a
    30-item chat body) gets fewer calls per batch, not a batch 60 times longer.
    """

    def __init__(self, min_time: float, repeat: int) -> None:
        self.min_time = min_time
        self.repeat = repeat

    def per_call(self, op: Callable[..., Any], fresh: Callable[[], Any] | None = None) -> Stat:
        """µs per `op()`, or per `op(fresh())` with `fresh()` called outside the timing."""
        number = self._calibrate(op, fresh)
        samples = [self._batch(op, fresh, number) / number for _ in range(self.repeat)]
        return Stat(statistics.median(samples) * 1e6, min(samples) * 1e6)

    @staticmethod
    def _batch(op: Callable[..., Any], fresh: Callable[[], Any] | None, number: int) -> float:
        """CPU seconds spent in `number` calls of `op`, not counting the making of their inputs."""
        if fresh is None:
            start = time.process_time()
            for _ in range(number):
                op()
            return time.process_time() - start
        spent = 0.0
        for left in range(number, 0, -CHUNK):
            inputs = [fresh() for _ in range(min(CHUNK, left))]
            start = time.process_time()
            for value in inputs:
                op(value)
            spent += time.process_time() - start
        return spent

    def _calibrate(self, op: Callable[..., Any], fresh: Callable[[], Any] | None) -> int:
        number = 1
        while True:
            start = time.process_time()
            self._batch(op, fresh, number)
            elapsed = time.process_time() - start  # with the inputs' making: what a batch will take
            if elapsed >= self.min_time / 4 or number >= 1 << 20:
                return max(1, round(number * self.min_time / max(elapsed, 1e-9)))
            number *= 4


Rows = list[tuple[str, Callable[[], Stat]]]  # (operation, what times it): timed when the run gets there


def request_rows(timer: Timer, boundary: Boundary, name: str) -> Rows:
    raw = (DATA / name).read_bytes()
    raw = orjson.dumps(orjson.loads(raw))  # compact, as a client sends it
    req = REQUEST_DECODER.decode(raw)
    body = boundary.prepare(to_chat_body(req, boundary), built=True)

    def prepare(built: dict[str, Any]) -> dict[str, Any]:
        return boundary.prepare(built, built=True)

    return [
        ("decode (typed ResponsesRequest)", lambda: timer.per_call(lambda: REQUEST_DECODER.decode(raw))),
        ("to_chat_body (with the boundary's rules)", lambda: timer.per_call(lambda: to_chat_body(req, boundary))),
        ("Boundary.prepare (the rest)", lambda: timer.per_call(prepare, lambda: to_chat_body(req, boundary))),
        ("encode the chat body", lambda: timer.per_call(lambda: ENCODER.encode(body))),
        (
            "total, bytes to bytes (as handlers.responses)",
            lambda: timer.per_call(
                lambda: ENCODER.encode(prepare(to_chat_body(REQUEST_DECODER.decode(raw), boundary)))
            ),
        ),
        ("for scale: orjson loads + dumps", lambda: timer.per_call(lambda: orjson.dumps(orjson.loads(raw)))),
    ]


def chat_request_rows(timer: Timer, boundary: Boundary) -> Rows:
    raw = orjson.dumps(orjson.loads((DATA / "chat_request.json").read_bytes()))

    def route() -> bytes:  # as handlers.chat_completions reads a request
        body = orjson.loads(raw)
        msgspec.convert(body, ChatRequestView)
        return ENCODER.encode(boundary.prepare(body))

    return [
        ("orjson.loads", lambda: timer.per_call(lambda: orjson.loads(raw))),
        (
            "validate (ChatRequestView)",
            lambda: timer.per_call(lambda: msgspec.convert(orjson.loads(raw), ChatRequestView)),
        ),
        ("Boundary.prepare", lambda: timer.per_call(boundary.prepare, lambda: orjson.loads(raw))),
        ("total, bytes to bytes", lambda: timer.per_call(route)),
    ]


def reply_rows(timer: Timer, name: str) -> Rows:
    req = REQUEST_DECODER.decode((DATA / "responses_short.json").read_bytes())
    payload = (DATA / name).read_bytes()
    response = to_response(COMPLETION_DECODER.decode(payload), req, model=MODEL, parser=True)

    def convert(completion: Any) -> Any:
        return to_response(completion, req, model=MODEL, parser=True)

    return [
        ("decode (ChatCompletion view)", lambda: timer.per_call(lambda: COMPLETION_DECODER.decode(payload))),
        ("to_response", lambda: timer.per_call(convert, lambda: COMPLETION_DECODER.decode(payload))),
        ("encode the Response", lambda: timer.per_call(lambda: ENCODER.encode(response))),
        (
            "total, bytes to bytes",
            lambda: timer.per_call(lambda: ENCODER.encode(convert(COMPLETION_DECODER.decode(payload)))),
        ),
        ("for scale: orjson loads + dumps", lambda: timer.per_call(lambda: orjson.dumps(orjson.loads(payload)))),
    ]


def stream_rows(timer: Timer) -> Rows:
    """Per upstream chunk, from one whole 200-chunk stream, each frame fed as its own read."""
    raw = (DATA / "chat_stream_tool.sse").read_bytes()
    frames = [frame + b"\n\n" for frame in raw.split(b"\n\n") if frame]
    chunks = len(frames) - 1  # without [DONE]
    req = REQUEST_DECODER.decode(
        orjson.dumps({**json.loads((DATA / "responses_short.json").read_text()), "stream": True})
    )

    def decode_only() -> None:
        decoder = SSEDecoder()
        for frame in frames:
            for payload in decoder.feed(frame):
                if payload != DONE:
                    CHUNK_DECODER.decode(payload)

    def responses() -> None:  # as streaming.relay_responses
        decoder = SSEDecoder()
        translator = ResponsesStream(req, model=MODEL, parser=True)
        out = [translator.start()]
        for frame in frames:
            for payload in decoder.feed(frame):
                if payload != DONE:
                    out.append(translator.feed(CHUNK_DECODER.decode(payload)))
        translator.finish()

    def chat_fold() -> None:  # as streaming.relay_chat with uses_reasoning_parser
        decoder = SSEDecoder()
        fold = ChatReasoningFolder(continued=False)
        out = []
        for frame in frames:
            for payload in decoder.feed(frame):
                if payload == DONE:
                    continue
                CHUNK_DECODER.decode(payload)
                if fold.needed(payload):
                    payload = fold.fold(payload)
                out.append(b"data: " + payload + b"\n\n")

    return [
        ("SSE decode + chunk decode", lambda: timer.per_call(decode_only) / chunks),
        ("responses: + ResponsesStream (start/feed/finish)", lambda: timer.per_call(responses) / chunks),
        ("chat: + reasoning fold into <think>", lambda: timer.per_call(chat_fold) / chunks),
    ]


class Section(NamedTuple):
    name: str  # short, for CSV
    title: str
    rows: Rows


def sections(timer: Timer) -> list[Section]:
    config = build_config({"base_url": ["http://127.0.0.1:1/v1"], "uses_reasoning_parser": True}, environ={})
    boundary = Boundary(rules(Rules, config))
    return [
        Section("request-1-turn", "Responses request -> chat body: responses_short.json (1 turn, 3 tools)",
                request_rows(timer, boundary, "responses_short.json")),
        Section("request-30-items", "Responses request -> chat body: responses_multiturn.json (30 items)",
                request_rows(timer, boundary, "responses_multiturn.json")),
        Section("chat-request", "chat request (the /v1/chat/completions route): chat_request.json",
                chat_request_rows(timer, boundary)),
        Section("reply-tool", "chat completion -> Response: chat_completion_tool.json (reasoning + tool call)",
                reply_rows(timer, "chat_completion_tool.json")),
        Section("reply-plain", "chat completion -> Response: chat_completion_plain.json (content only)",
                reply_rows(timer, "chat_completion_plain.json")),
        Section("stream-chunk", "stream, per upstream chunk: chat_stream_tool.sse (200 chunks)", stream_rows(timer)),
    ]  # fmt: skip


Results = list[tuple[Section, list[tuple[str, Stat]]]]


def run(args: argparse.Namespace) -> Results:
    """Time every operation; with the text format, print each section as it is done."""
    todo = sections(Timer(args.min_time, args.repeat))
    progress = Progress(sum(len(s.rows) for s in todo), quiet=args.quiet)
    results: Results = []
    for section in todo:
        rows = [(label, timed()) for label, timed in section.rows]
        results.append((section, rows))
        progress.step(f"{section.name}: {len(rows)} operations timed", len(rows))
        if args.format == "text":
            print(render_text([(section, rows)]), flush=True)
    return results


def render_text(results: Results) -> str:
    lines = []
    for section, rows in results:
        lines += ["", section.title, f"  {'':50} {'median':>9} {'best':>9}"]
        lines += [f"  {label:50} {value.median:9.2f} {value.best:9.2f}" for label, value in rows]
    return "\n".join(lines)


COLUMNS = (Column("operation", "operation"), Column("median_us", "median µs", 2), Column("best_us", "best µs", 2))


def tables(results: Results) -> list[Table]:
    return [Table(s.name, s.title, COLUMNS, [(label, v.median, v.best) for label, v in rows]) for s, rows in results]


QUICK = {"min_time": 0.05, "repeat": 3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_convert.py", description=__doc__.split("\n")[0])
    parser.add_argument("--min-time", type=float, default=0.2, help="CPU seconds per timed batch (default 0.2)")
    parser.add_argument("--repeat", type=int, default=7, help="timed batches; the median is reported (default 7)")
    options.add(parser, quick="3 batches of ~0.05 s CPU an operation: ~7 s")
    return options.parse(parser, argv, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    head = f"conversion micro-benchmark: median of {args.repeat} batches of ~{args.min_time:g} s, µs per operation"
    if args.format == "text":
        print(head, flush=True)
    results = run(args)
    if args.format == "json":
        document = {
            "unit": "µs per operation",
            "repeat": args.repeat,
            "min_time": args.min_time,
            "sections": {s.title: {label: v._asdict() for label, v in rows} for s, rows in results},
        }
        print(json.dumps(document, indent=1))
    elif args.format == "markdown":
        print(f"{head}\n\n{markdown(tables(results))}")
    elif args.format == "csv":
        print(csv_text(tables(results), "section"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
