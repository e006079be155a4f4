"""The agent harnesses of the real-client suite: Codex CLI and Claude Code, run as their users run them.

Each harness gets its own temporary home (HOME, and CODEX_HOME or CLAUDE_CONFIG_DIR), a working
directory, and an environment made from scratch: nothing of the caller's (no API keys, no proxy
settings) leaks in, telemetry, update checks and non-essential traffic are off, and retries are
off so that a failure shows at once. A run that outlives its timeout is killed with its whole
process group, and its output is kept for the failure message.

What each harness sends (recorded from Codex CLI 0.169.0 and Claude Code 2.1.332; samples in
tests/data/harnesses/):

- `codex exec` streams `POST /v1/responses` and nothing else (no `/v1/models`). Headers:
  `session-id`, `thread-id`, `x-client-request-id` (all the session's id), `x-codex-window-id`,
  `x-codex-turn-metadata`, `originator: codex_exec`; no Authorization without an `env_key`.
  The body has no `instructions` (the system prompt is a `developer` message), input messages
  carry ids, `tools` holds functions, a `namespace` of functions and the hosted `web_search`; also
  `store: false`, `include: ["reasoning.encrypted_content"]`, `reasoning: {summary: auto}`,
  `prompt_cache_key` (the session id) and `client_metadata`.
- `claude -p` streams `POST /v1/messages?beta=true` and nothing else when non-essential traffic
  is off (otherwise a `HEAD /api/hello` first; no count_tokens in print mode). Headers:
  `x-api-key`, `anthropic-version`, `anthropic-beta`, `X-Claude-Code-Session-Id`, `x-app: cli`.
  The body asks for `max_tokens: 32000`, `thinking: {type: adaptive}`, `context_management`,
  `output_config`, and puts a `system` message after the user's. A 404 on the stream makes it
  try once more without streaming.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .harness import MODEL_NAME

HERE = Path(__file__).resolve().parent
KILLED = -signal.SIGKILL


@dataclass(frozen=True)
class Run:
    """One finished (or killed) harness process."""

    argv: list[str]
    returncode: int  # KILLED when the timeout ran out
    stdout: str
    stderr: str
    seconds: float
    timeout: float

    @property
    def timed_out(self) -> bool:
        return self.returncode == KILLED

    def report(self) -> str:
        """Everything a failure message needs: the command, how it ended, and all it printed."""
        ended = f"killed after its {self.timeout:.0f} s timeout" if self.timed_out else f"exit {self.returncode}"
        return (
            f"$ {shlex.join(self.argv)}\n({ended}, {self.seconds:.1f} s)\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-6000:]}"
        )

    def check(self, context: str = "") -> Run:
        """This run, if it exited 0; else an AssertionError with its report (and `context`)."""
        assert self.returncode == 0, f"{self.report()}\n{context}"
        return self


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Run:
    """Run `argv` to completion or to `timeout`, whichever comes first; never hangs."""
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group: a timeout kills the commands it ran too
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = KILLED
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired as exc:  # a descendant in a session of its own holds the pipes
            stdout, stderr = (_decoded(exc.stdout), _decoded(exc.stderr) + "\n(output pipes still held open)")
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait(10)
    return Run(argv, code, stdout, stderr, time.monotonic() - started, timeout)


def _decoded(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def base_env(home: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }


class Codex:
    """`codex exec` with a model provider pointing at gymproxy's Responses API."""

    name = "codex"
    route = "/v1/responses"

    def __init__(self, executable: str, root: Path) -> None:
        self.executable = executable
        self.root = root
        self.home = root / "home"
        self.codex_home = root / "codex-home"
        self.workdir = root / "work"
        for path in (self.home, self.codex_home, self.workdir):
            path.mkdir(parents=True, exist_ok=True)

    def configure(self, base_url: str) -> None:
        # --strict-config below makes a key this version does not know an error, not a silent no-op.
        (self.codex_home / "config.toml").write_text(
            f"""\
model = "{MODEL_NAME}"
model_provider = "gymproxy"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.gymproxy]
name = "gymproxy"
base_url = "{base_url}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""
        )

    def run(self, prompt: str, *, url: str, timeout: float, again: bool = False) -> Run:
        """One `codex exec` turn against gymproxy at `url` (its root); `again` resumes the last session."""
        self.configure(url + "/v1")
        argv = [self.executable, "exec", "--strict-config", "--skip-git-repo-check", "--color", "never"]
        argv += ["resume", "--last", prompt] if again else [prompt]
        env = {**base_env(self.home), "CODEX_HOME": str(self.codex_home)}
        return run(argv, env, self.workdir, timeout)

    @staticmethod
    def shell_call(command: str) -> str:
        """The fake vLLM directive that makes the model run `command` with Codex's shell tool."""
        return "[[call:exec_command " + json.dumps({"cmd": command}) + "]]"


class ClaudeCode:
    """`claude -p` with ANTHROPIC_BASE_URL pointing at gymproxy."""

    name = "claude"
    route = "/v1/messages"

    def __init__(self, executable: str, root: Path) -> None:
        self.executable = executable
        self.root = root
        self.home = root / "home"
        self.config_dir = root / "claude-config"
        self.workdir = root / "work"
        for path in (self.home, self.config_dir, self.workdir):
            path.mkdir(parents=True, exist_ok=True)

    def run(self, prompt: str, *, url: str, timeout: float, again: bool = False) -> Run:
        """One `claude -p` turn against gymproxy at `url` (its root); `again` continues the last conversation."""
        argv = [self.executable, "-p", prompt, "--model", MODEL_NAME, "--allowedTools", "Bash"]
        argv += ["--continue"] if again else []
        env = {
            **base_env(self.home),
            "CLAUDE_CONFIG_DIR": str(self.config_dir),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "sk-ant-gymproxy-test",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
        return run(argv, env, self.workdir, timeout)

    @staticmethod
    def shell_call(command: str) -> str:
        """The fake vLLM directive that makes the model run `command` with Claude Code's Bash tool."""
        return "[[call:Bash " + json.dumps({"command": command, "description": "Print a marker"}) + "]]"


Harness = Codex | ClaudeCode


@dataclass(frozen=True)
class Turn:
    """One message of a conversation as a harness sent it, in either API's shape."""

    role: str  # user, assistant or tool (a tool result); system notes are left out
    text: str
    calls: tuple[str, ...] = ()  # names of the tools an assistant message called


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part.get("text", part.get("content"))) for part in content if isinstance(part, dict))
    return ""


def responses_turns(body: dict[str, Any]) -> list[Turn]:
    """A Responses request's input as turns (developer/system messages left out)."""
    turns: list[Turn] = []
    for item in body.get("input") or []:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "assistant"):
            turns.append(Turn(item["role"], _text(item.get("content"))))
        elif kind == "function_call":
            turns.append(Turn("assistant", "", (item["name"],)))
        elif kind == "function_call_output":
            turns.append(Turn("tool", _text(item.get("output"))))
    return turns


def chat_turns(body: dict[str, Any]) -> list[Turn]:
    """A chat request's messages as turns (system/developer messages left out)."""
    turns: list[Turn] = []
    for message in body.get("messages") or []:
        role = message.get("role")
        if role in ("user", "assistant", "tool"):
            calls = tuple(c["function"]["name"] for c in message.get("tool_calls") or [])
            turns.append(Turn(role, _text(message.get("content")), calls))
    return turns


def messages_turns(body: dict[str, Any]) -> list[Turn]:
    """An Anthropic Messages request as turns: tool_result blocks become tool turns."""
    turns: list[Turn] = []
    for message in body.get("messages") or []:
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        results = [b for b in blocks if b.get("type") == "tool_result"]
        turns += [Turn("tool", _text(b.get("content"))) for b in results]
        text = "".join(b.get("text") or "" for b in blocks if b.get("type") == "text")
        calls = tuple(b["name"] for b in blocks if b.get("type") == "tool_use")
        if text or calls or not results:
            turns.append(Turn(role, text, calls))
    return turns


def turns(path: str, body: dict[str, Any]) -> list[Turn]:
    """The turns of any generation request, by its route."""
    if path.startswith("/v1/responses"):
        return responses_turns(body)
    if path.startswith("/v1/messages"):
        return messages_turns(body)
    return chat_turns(body)


# --- samples of what the harnesses send, for tests/data/harnesses/ ------------------------------

SAMPLES = HERE.parent / "data" / "harnesses"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
_DROPPED = {"host", "content-length", "connection"}
LONG = 400  # body strings longer than this are cut (system prompts, tool descriptions)


class Redactor:
    """Makes a recorded request shareable: stable fake ids, no local paths, long texts cut."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths = paths  # local path -> what to write instead
        self.ids: dict[str, str] = {}

    def _uuid(self, match: re.Match[str]) -> str:
        return self.ids.setdefault(match[0], f"00000000-0000-4000-8000-{len(self.ids) + 1:012d}")

    def text(self, value: str) -> str:
        for path, instead in self.paths.items():
            value = value.replace(path, instead)
        value = value.replace(os.uname().release, "<kernel release>")
        return _HEX64.sub("0" * 64, _UUID.sub(self._uuid, value))

    def body(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.body(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.body(v) for v in value]
        if isinstance(value, str):
            value = self.text(value)
            if len(value) > LONG:
                value = value[:LONG] + f" [... {len(value) - LONG} characters cut from the sample]"
        return value


def sample(harness: Harness, exchange: Any, version: str, command: str) -> dict[str, Any]:
    """The first request of a harness run (a tap Exchange), redacted, as a test data file holds it."""
    redactor = Redactor({str(harness.root): "/home/user"})
    headers = {}
    for name, value in exchange.request_headers.items():
        if name.lower() in _DROPPED:
            continue
        headers[name] = "sk-ant-redacted" if name.lower() == "x-api-key" else redactor.text(value)
    return {
        "harness": version,
        "command": command,
        "note": "Recorded by tests/integration/test_harnesses.py (GYMPROXY_RECORD=1) at gymproxy's door; ids "
        f"replaced by stable fake ones, local paths renamed, body strings over {LONG} characters cut.",
        "method": exchange.method,
        "path": exchange.path,
        "headers": headers,
        "body": redactor.body(json.loads(exchange.request)),
    }
