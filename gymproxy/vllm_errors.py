"""Why a launched vLLM failed, read from its last output lines: the one line that says so, and a
hint for the failures users meet first (a model name that does not resolve, a gated model, no
network, no memory, an option vLLM does not know).

vLLM ends a failed start with one or more tracebacks (the API server's and its EngineCore's, each
line prefixed with the process and the log header), and the line that names the cause is the
exception's own, often followed by more lines of its message, or by a later "see root cause above"
from the process that noticed. `cause` finds that line; `hint` says what to check. Both are pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

# `(APIServer pid=12) `, `(EngineCore_DP0 pid=34) `, then `ERROR 12-06 10:00:00 [core.py:700] `.
_PREFIX = re.compile(
    r"^(?:\([\w.:-]+ pid=\d+(?:, ip=[\d.]+)?\)\s*)?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?:\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+)?(?:\[[^\]]*\]\s*)?)?"
)
# `ValueError: ...`, `huggingface_hub.errors.GatedRepoError: ...`, `torch.OutOfMemoryError: ...`
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))(?::\s*(.*))?$")
_ARGPARSE = re.compile(r"^[\w .-]*: error: (.+)$")  # `vllm serve: error: unrecognized arguments: --x`
_LEVEL = re.compile(r"\b(?:ERROR|CRITICAL)\b")
_AFTERWARDS = ("see root cause above", "see stack trace above", "see the logs above")
# pydantic's first line counts errors; the next one says what they are.
_COUNTED = re.compile(r"^\d+ validation errors? for \w+$")
CAUSE_MAX = 400  # characters of a cause line kept


def cause(lines: Sequence[str]) -> str | None:
    """The line of `lines` (a process's last output lines, oldest first) that says why it failed:
    the last exception line that is not a pointer to an earlier one, else vLLM's own usage error,
    else the last ERROR line; None when nothing says."""
    bare = [_PREFIX.sub("", line).strip() for line in lines]
    found: str | None = None
    for i in range(len(bare) - 1, -1, -1):
        match = _EXCEPTION.match(bare[i])
        if match is None:
            continue
        message = (match.group(2) or "").strip()
        if any(marker in message.lower() for marker in _AFTERWARDS):
            found = found or bare[i]  # kept in case nothing better comes before it
            continue
        if _COUNTED.match(message):
            more = next((line for line in bare[i + 1 :] if line), "")
            message = f"{message}: {more.removeprefix('Value error, ')}"
        return _short(f"{match.group(1).rsplit('.', 1)[-1]}: {message}" if message else match.group(1))
    if found is not None:
        return _short(found)
    usage = next((m.group(1) for line in reversed(bare) if (m := _ARGPARSE.match(line))), None)
    if usage is not None:
        return _short(f"vllm serve: {usage}")
    raw = next((line for line in reversed(lines) if _LEVEL.search(line)), None)
    return None if raw is None else _short(_PREFIX.sub("", raw).strip())


def hint(text: str, model: str, environ: Mapping[str, str]) -> str | None:
    """What to check, for the failures users meet first; `text` is the cause and the last lines,
    `environ` the replica's environment (whether HF_TOKEN and the offline switches are set)."""
    lower = text.lower()
    if any(
        marker in lower
        for marker in (
            "invalid repository id or local directory",
            "is not a valid model identifier",
            "repositorynotfounderror",
            "repository not found",
            "gatedrepoerror",
            "gated repo",
            "localentrynotfounderror",
            "offline mode",
            "couldn't connect to",
            "cannot find the requested files",
        )
    ):
        token = (
            "HF_TOKEN is set" if environ.get("HF_TOKEN") else "no HF_TOKEN is set (a gated or private model needs one)"
        )
        offline = [
            name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if environ.get(name) not in (None, "", "0")
        ]
        where = (
            f"{' and '.join(offline)} set: the model must already be in the cache (launch.hf_home)"
            if offline
            else "without network access the model must already be in the cache (launch.hf_home)"
        )
        return (
            f"check the model {model!r} (launch.model, --launch-vllm): a Hugging Face repository id or a local "
            f"directory with config.json; {token}; {where}"
        )
    if any(m in lower for m in ("out of memory", "outofmemoryerror", "no available memory for the cache blocks")):
        return (
            "the model does not fit: lower --max-model-len or raise --gpu-memory-utilization in launch.args, "
            "or give each replica more GPUs (launch.gpus_per_replica with -tp)"
        )
    if "unrecognized arguments" in lower or "unrecognized argument" in lower:
        return "launch.args has an option this vLLM does not know (`vllm serve --help` lists them)"
    return None


def _short(line: str) -> str:
    return line if len(line) <= CAUSE_MAX else f"{line[:CAUSE_MAX]}..."
