"""Write the benchmark payloads in bench/data/: realistic requests and vLLM 0.32 replies.

The files are checked in; rerun this only to change them (`python bench/make_data.py`). Everything
is deterministic, so the files only change when this script does.

    responses_short.json       a one-turn Responses request: instructions, a user message, 3 tools
    responses_multiturn.json   a 30-item agent rollout: reasoning, function calls and their outputs
    chat_request.json          a Chat Completions request with a system prompt and 3 tools
    chat_completion_plain.json vLLM 0.32's non-streamed reply, content only (`reasoning: null`)
    chat_completion_tool.json  the same with reasoning, a short answer and one tool call
    chat_stream_tool.sse       that reply streamed: role chunk, 197 deltas, finish, usage: 200 chunks
    *_tokens.json, *_tokens.sse the same replies as vLLM sends them when asked for the tokens
                               (`return_token_ids`, `logprobs` with `top_logprobs: 0`), as a capturing
                               gymproxy asks: the prompt's 812 ids, each generated token's id and log prob
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
MODEL = "Qwen/Qwen3-8B"
CREATED = 1764000000
COMPLETION_ID = "chatcmpl-5f0c1e8d9b2a4c7e8f1a2b3c4d5e6f70"
CALL_ID = "chatcmpl-tool-8d2f6a4b1c9e4f0a"

# Chunk counts of the streamed reply: 1 role + reasoning + content + tool call + 1 finish + 1 usage.
STREAM_REASONING = 60
STREAM_CONTENT = 100
STREAM_ARGUMENTS = 36  # argument fragments after the tool call's first delta

INSTRUCTIONS = (
    "You are a careful software engineering agent working in a Linux container. Use the tools to "
    "inspect the repository before you change anything. Run the tests after every change. When the "
    "task is done, answer with a short summary of what you changed and why."
)

TASK = (
    "The nightly job reports that `parse_duration('1h30m')` returns 5400.0 on Linux but raises "
    "ValueError on the Windows runners. Find the cause in the `timeutil` package, fix it, and add a "
    "regression test. Do not change the public API."
)

REASONING_TEXT = (
    "The user wants me to look into a parsing bug that only shows on one platform. The most likely "
    "cause is a regular expression or a locale dependent call. I should start by listing the files "
    "in the package and reading the parser, then look at how the tests run on each platform. If the "
    "parser uses a platform specific separator or a locale aware float conversion that would explain "
    "it. I will search for the function definition first and read the surrounding code before I "
    "decide what to change, and I will keep the public signature exactly as it is."
)

ANSWER_TEXT = (
    "I will start by finding where `parse_duration` is defined and reading it, because the failure "
    "only appears on one platform and the parser is the most likely place for a platform dependent "
    "assumption. After that I will run the existing tests to see the baseline, write a failing "
    "regression test that reproduces the Windows behaviour on Linux, and then make the smallest fix "
    "that keeps the public API unchanged. I will report back with the diff and the test results once "
    "everything passes on both code paths, including the edge cases with spaces and upper case units "
    "that the current tests do not cover yet, so that the nightly job stays green from now on."
)

TOOL_ARGUMENTS = json.dumps(
    {
        "pattern": "def parse_duration",
        "path": "src/timeutil",
        "include": ["*.py"],
        "context_lines": 12,
        "case_sensitive": True,
    },
    separators=(", ", ": "),
)

RESPONSES_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "search_code",
        "description": "Search the repository for a regular expression and return matching lines with context.",
        "parameters": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "A Python regular expression."},
                "path": {"type": "string", "description": "Directory to search, relative to the repository root."},
                "include": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Glob patterns of files to search.",
                },
                "context_lines": {"type": "integer", "minimum": 0, "maximum": 50},
                "case_sensitive": {"type": "boolean"},
            },
            "required": ["pattern"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a text file, optionally only a range of lines.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "start_line": {"type": "integer", "minimum": 1},
                "end_line": {"type": "integer", "minimum": 1},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "run_command",
        "description": "Run a shell command in the repository and return its exit code, stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout_s": {"type": "number", "minimum": 1, "maximum": 600},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
        "strict": True,
    },
]

CHAT_TOOLS = [
    {
        "type": "function",
        "function": {k: v for k, v in tool.items() if k not in ("type",)},
    }
    for tool in RESPONSES_TOOLS
]

# The agent's steps in the multi-turn rollout: (reasoning, tool, arguments, tool output).
STEPS = [
    (
        "I need to find the parser first. A code search for the definition is the quickest way.",
        "search_code",
        {"pattern": "def parse_duration", "path": "src"},
        "src/timeutil/parse.py:41: def parse_duration(text: str) -> float:\n"
        "src/timeutil/parse.py:42:     \"\"\"Parse '1h30m', '90s' or '2.5h' into seconds.\"\"\"",
    ),
    (
        "Found it in parse.py around line 41. I will read the whole function and the module header to see the imports.",
        "read_file",
        {"path": "src/timeutil/parse.py", "start_line": 1, "end_line": 90},
        "\n".join(
            f"{n:4d}  {line}"
            for n, line in enumerate(
                [
                    '"""Duration and timestamp parsing."""',
                    "",
                    "import locale",
                    "import os",
                    "import re",
                    "",
                    "_UNITS = {'h': 3600.0, 'm': 60.0, 's': 1.0, 'ms': 0.001}",
                    "_TOKEN = re.compile(r'(\\d+(?:[.,]\\d+)?)(' + os.sep.join(['h', 'm', 's']) + r')')",
                    "",
                    "def _number(text):",
                    "    return locale.atof(text)",
                    "",
                    "def parse_duration(text: str) -> float:",
                    "    \"\"\"Parse '1h30m', '90s' or '2.5h' into seconds.\"\"\"",
                    "    total = 0.0",
                    "    position = 0",
                    "    for match in _TOKEN.finditer(text.strip()):",
                    "        if match.start() != position:",
                    "            raise ValueError(f'unexpected text at {position}: {text!r}')",
                    "        total += _number(match.group(1)) * _UNITS[match.group(2)]",
                    "        position = match.end()",
                    "    if position != len(text.strip()):",
                    "        raise ValueError(f'trailing text in {text!r}')",
                    "    return total",
                ]
                * 3,
                start=1,
            )
        ),
    ),
    (
        "The token pattern joins the unit letters with os.sep, which is a slash on Linux but a backslash on "
        "Windows, so the alternation becomes an escape sequence there. That is the bug. I should check the tests.",
        "search_code",
        {"pattern": "parse_duration", "path": "tests", "context_lines": 3},
        "tests/test_parse.py:12: def test_parse_duration_hours_minutes():\n"
        "tests/test_parse.py:13:     assert parse_duration('1h30m') == 5400.0\n"
        "tests/test_parse.py:14: \n"
        "tests/test_parse.py:15: def test_parse_duration_seconds():\n"
        "tests/test_parse.py:16:     assert parse_duration('90s') == 90.0\n" * 4,
    ),
    (
        "The tests only run on the host platform, so they never see the Windows separator. I will run them to get a baseline.",
        "run_command",
        {"command": "python -m pytest -q tests/test_parse.py", "timeout_s": 120},
        "exit code 0\nstdout:\n" + "." * 24 + "\n24 passed in 0.31s\nstderr:\n",
    ),
    (
        "Baseline is green. Now I will write the fix: build the alternation with '|' explicitly and stop using "
        "locale.atof, which also breaks under a comma-decimal locale. Then a regression test that patches os.sep.",
        "run_command",
        {
            "command": "python - <<'EOF'\nimport re, pathlib\np = pathlib.Path('src/timeutil/parse.py')\n"
            "s = p.read_text().replace(\"os.sep.join(['h', 'm', 's'])\", \"'ms|h|m|s'\")\n"
            "s = s.replace('locale.atof(text)', \"float(text.replace(',', '.'))\")\np.write_text(s)\nEOF",
            "timeout_s": 30,
        },
        "exit code 0\nstdout:\n\nstderr:\n",
    ),
    (
        "The fix is applied. I will add the regression test now and run the whole suite.",
        "run_command",
        {"command": "python -m pytest -q", "timeout_s": 600},
        "exit code 0\nstdout:\n" + "." * 212 + "\n212 passed, 3 skipped in 4.87s\nstderr:\n",
    ),
    (
        "The suite is green. I should read the new regression test once more to be sure it really covers Windows.",
        "read_file",
        {"path": "tests/test_parse.py", "start_line": 1, "end_line": 40},
        "from unittest import mock\n\nfrom timeutil.parse import parse_duration\n\n\n"
        "def test_parse_duration_ignores_os_sep():\n    with mock.patch('os.sep', '\\\\'):\n"
        "        assert parse_duration('1h30m') == 5400.0\n\n\n"
        "def test_parse_duration_comma_decimal():\n    assert parse_duration('2,5h') == 9000.0\n",
    ),
    (
        "Everything passes, including the new test that simulates the Windows separator. I will show the final diff.",
        "run_command",
        {"command": "git diff --stat && git diff src/timeutil/parse.py", "timeout_s": 30},
        " src/timeutil/parse.py   | 6 ++----\n tests/test_parse.py     | 9 +++++++++\n 2 files changed\n"
        "-_TOKEN = re.compile(r'(\\d+(?:[.,]\\d+)?)(' + os.sep.join(['h', 'm', 's']) + r')')\n"
        "+_TOKEN = re.compile(r'(\\d+(?:[.,]\\d+)?)(ms|h|m|s)')\n"
        "-    return locale.atof(text)\n+    return float(text.replace(',', '.'))\n",
    ),
]


def responses_short() -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": TASK}]}],
        "tools": RESPONSES_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium"},
        "max_output_tokens": 4096,
        "temperature": 1.0,
        "top_p": 0.95,
    }


def responses_multiturn() -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "input_text", "text": TASK}]}]
    for n, (thought, tool, arguments, output) in enumerate(STEPS):
        call_id = f"call_{n:02d}a7c3e9f1b5d2"
        items.append({"type": "reasoning", "id": f"rs_{n:02d}", "summary": [{"type": "summary_text", "text": thought}]})
        items.append(
            {"type": "function_call", "id": f"fc_{n:02d}", "call_id": call_id, "name": tool,
             "arguments": json.dumps(arguments), "status": "completed"}
        )  # fmt: skip
        items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        if n in (2, 5):  # the agent narrates now and then
            items.append(_assistant(f"Step {n + 1} done: " + _words(thought, 12)))
    items.append(
        {"type": "reasoning", "id": "rs_done", "summary": [{"type": "summary_text", "text": "All green; summarise."}]}
    )
    items.append(_assistant(ANSWER_TEXT))
    items.append(
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Thanks. Now also make '1H30M' work, case-insensitively."}],
        }
    )
    body = responses_short()
    body["input"] = items
    assert len(items) == 30, len(items)
    return body


def _assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "id": f"msg_{zlib.crc32(text.encode()):08x}", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def chat_request() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": TASK}],
        "tools": CHAT_TOOLS,
        "tool_choice": "auto",
        "max_tokens": 4096,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 20,
    }


def _usage(completion_tokens: int, *, stream: bool) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if not stream:
        usage["prompt_tokens_details"] = None  # the stream's usage chunk is dumped with exclude_none
    return usage


PROMPT_TOKENS = 812


def _token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 151_000


def _entry(piece: str) -> dict[str, Any]:
    """One generated token's log prob, as vLLM 0.32 writes it with `top_logprobs: 0`."""
    return {"token": piece, "logprob": -((_token_id(piece) % 997) + 1) / 1000, "bytes": list(piece.encode()),
            "top_logprobs": []}  # fmt: skip


def _prompt_ids() -> list[int]:
    return [_token_id(f"prompt {i}") for i in range(PROMPT_TOKENS)]


def _with_tokens(reply: dict[str, Any], pieces: list[str]) -> dict[str, Any]:
    """A whole reply as vLLM sends it when asked for its tokens."""
    choice = {**reply["choices"][0], "logprobs": {"content": [_entry(p) for p in pieces]},
              "token_ids": [_token_id(p) for p in pieces]}  # fmt: skip
    return {**reply, "choices": [choice], "prompt_token_ids": _prompt_ids()}


def _generated(message: dict[str, Any], count: int) -> list[str]:
    """A reply's generated text cut into its `count` tokens."""
    calls = "".join(c["function"]["name"] + c["function"]["arguments"] for c in message.get("tool_calls") or [])
    return _chars((message.get("reasoning") or "") + (message.get("content") or "") + calls, count)


def _completion(message: dict[str, Any], finish_reason: str, completion_tokens: int) -> dict[str, Any]:
    full: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [], "reasoning": None}  # fmt: skip
    full.update(message)
    return {
        "id": COMPLETION_ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": full,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(completion_tokens, stream=False),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }


def chat_completion_plain() -> dict[str, Any]:
    return _completion({"content": ANSWER_TEXT}, "stop", 118)


def chat_completion_tool() -> dict[str, Any]:
    call = {"id": CALL_ID, "type": "function", "function": {"name": "search_code", "arguments": TOOL_ARGUMENTS}}
    return _completion(
        {"content": _words(ANSWER_TEXT, 30), "reasoning": REASONING_TEXT, "tool_calls": [call]}, "tool_calls", 197
    )


def _words(text: str, count: int) -> str:
    return " ".join(text.split(" ")[:count])


def _pieces(text: str, count: int) -> list[str]:
    """`text` cut into `count` token-like pieces (a leading space stays with its word)."""
    words = text.split(" ")
    bounds = [len(words) * i // count for i in range(count + 1)]
    out = [" ".join(words[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [piece if i == 0 else " " + piece for i, piece in enumerate(out)]


def _tokens_of(reply: dict[str, Any]) -> dict[str, Any]:
    message = reply["choices"][0]["message"]
    return _with_tokens(reply, _generated(message, reply["usage"]["completion_tokens"]))


def chat_stream_tool(*, tokens: bool = False) -> list[dict[str, Any]]:
    """vLLM 0.32's chunks for chat_completion_tool, in order (without the final [DONE]); with
    `tokens`, as it streams them when asked for the tokens (one generated token a delta chunk)."""
    base = {"id": COMPLETION_ID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        piece = "".join(str(v) for v in delta.values() if isinstance(v, str)) or "x"
        generated = tokens and finish_reason is None and "role" not in delta
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": {"content": [_entry(piece)] if generated else []} if tokens else None,
            "finish_reason": finish_reason,
            **extra,
            "token_ids": ([_token_id(piece)] if generated else []) if tokens else None,
        }
        return {**base, "choices": [choice]}

    prompt = _prompt_ids() if tokens else None
    chunks = [{**chunk({"role": "assistant", "content": ""}), "prompt_token_ids": prompt}]
    chunks += [chunk({"reasoning": p}) for p in _pieces(REASONING_TEXT, STREAM_REASONING)]
    chunks += [chunk({"content": p}) for p in _pieces(ANSWER_TEXT, STREAM_CONTENT)]
    fragments = _chars(TOOL_ARGUMENTS, STREAM_ARGUMENTS + 1)
    head = {
        "id": CALL_ID,
        "type": "function",
        "index": 0,
        "function": {"name": "search_code", "arguments": fragments[0]},
    }
    chunks.append(chunk({"tool_calls": [head]}))
    chunks += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": f}}]}) for f in fragments[1:]]
    chunks.append(chunk({}, "tool_calls", stop_reason=None))
    chunks.append({**base, "choices": [], "usage": _usage(len(chunks) - 2, stream=True)})
    assert len(chunks) == 200, len(chunks)
    return chunks


def _chars(text: str, count: int) -> list[str]:
    bounds = [len(text) * i // count for i in range(count + 1)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _dump(obj: Any) -> bytes:
    # vLLM (pydantic) writes compact JSON with non-ASCII kept as is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def files() -> dict[str, bytes]:
    """Every file of bench/data/ by name, as this script writes it."""
    requests = {
        "responses_short.json": responses_short(),
        "responses_multiturn.json": responses_multiturn(),
        "chat_request.json": chat_request(),
    }
    # Requests are read and re-encoded by the benchmarks, so they are kept readable.
    out = {name: (json.dumps(obj, indent=1) + "\n").encode() for name, obj in requests.items()}
    out["chat_completion_plain.json"] = _dump(chat_completion_plain())
    out["chat_completion_tool.json"] = _dump(chat_completion_tool())
    frames = b"".join(b"data: " + _dump(c) + b"\n\n" for c in chat_stream_tool())
    out["chat_stream_tool.sse"] = frames + b"data: [DONE]\n\n"
    out["chat_completion_plain_tokens.json"] = _dump(_tokens_of(chat_completion_plain()))
    out["chat_completion_tool_tokens.json"] = _dump(_tokens_of(chat_completion_tool()))
    frames = b"".join(b"data: " + _dump(c) + b"\n\n" for c in chat_stream_tool(tokens=True))
    out["chat_stream_tool_tokens.sse"] = frames + b"data: [DONE]\n\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that bench/data/ is up to date")
    args = parser.parse_args(argv)
    wanted = files()
    if args.check:
        stale = [
            name for name, data in wanted.items() if not (DATA / name).is_file() or (DATA / name).read_bytes() != data
        ]
        print(
            f"bench/data/ is stale: {', '.join(stale)}; run bench/make_data.py"
            if stale
            else "bench/data/ is up to date"
        )
        return 1 if stale else 0
    DATA.mkdir(exist_ok=True)
    for name, data in wanted.items():
        (DATA / name).write_bytes(data)
        print(f"{len(data):8d}  bench/data/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
