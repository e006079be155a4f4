"""`vllm_errors`: the line of a failed vLLM's output that says why, and the hint for it."""

from __future__ import annotations

import pytest

from gymproxy.launch import Replica
from gymproxy.vllm_errors import cause, hint

API = "(APIServer pid=7)"
CORE = "(EngineCore_DP0 pid=9)"


def test_the_exception_line_of_a_prefixed_traceback():
    lines = [
        f"{API} INFO 12-06 10:00:00 [api_server.py:1] vLLM API server version 0.32.0",
        f"{API} Traceback (most recent call last):",
        f'{API}   File "/venv/lib/python3.12/site-packages/transformers/utils/hub.py", line 479, in cached_file',
        f"{API}     raise EnvironmentError(",
        f"{API} OSError: org/x is not a local folder and is not a valid model identifier listed on "
        "'https://huggingface.co/models'",
        f"{API} If this is a private repository, make sure to pass a token having permission to this repo",
    ]
    assert cause(lines) == (
        "OSError: org/x is not a local folder and is not a valid model identifier listed on "
        "'https://huggingface.co/models'"
    )


def test_an_engine_failure_names_the_engines_error_not_the_pointer_to_it():
    lines = [
        f"{CORE} ERROR 12-06 10:00:01 [core.py:708] EngineCore failed to start.",
        f"{CORE} ERROR 12-06 10:00:01 [core.py:708] Traceback (most recent call last):",
        f"{CORE} ERROR 12-06 10:00:01 [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        f"{API} Traceback (most recent call last):",
        f"{API} RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{}}",
    ]
    found = cause(lines)
    assert found == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    advice = hint(found, "m", {})
    assert advice is not None and "--gpu-memory-utilization" in advice and "--max-model-len" in advice


def test_a_pydantic_error_is_read_with_its_next_line():
    lines = [
        f"{API} pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        f"{API}   Value error, Invalid repository ID or local directory specified: 'org/x'.",
        f"{API} Please verify the following requirements:",
        f"{API} 1. Provide a valid Hugging Face repository ID.",
    ]
    found = cause(lines)
    assert found == (
        "ValidationError: 1 validation error for ModelConfig: Invalid repository ID or local directory "
        "specified: 'org/x'."
    )
    advice = hint(found, "org/x", {"HF_TOKEN": "hf_x"})
    assert advice is not None
    assert "check the model 'org/x'" in advice and "HF_TOKEN is set" in advice and "without network" in advice
    offline = hint(found, "org/x", {"HF_HUB_OFFLINE": "1"})
    assert offline is not None and "no HF_TOKEN is set" in offline and "HF_HUB_OFFLINE set" in offline


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            ["usage: vllm serve [model_tag] [options]", "vllm serve: error: unrecognized arguments: --bogus"],
            "vllm serve: unrecognized arguments: --bogus",
        ),
        (["INFO loading", "ERROR 12-06 10:00:00 [x.py:1] the disk is full", "INFO bye"], "the disk is full"),
        (["INFO all is well", "INFO bye"], None),
        ([], None),
        (
            [f"{API} RuntimeError: Engine core initialization failed. See root cause above."],
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ),
    ],
)
def test_other_shapes(lines: list[str], expected: str | None):
    assert cause(lines) == expected


def test_an_unknown_option_gets_its_hint():
    advice = hint("vllm serve: unrecognized arguments: --bogus", "m", {})
    assert advice is not None and "vllm serve --help" in advice
    assert hint("KeyError: 'x'", "m", {}) is None


def test_a_cause_never_shows_the_replicas_secrets():
    key = "k" * 40
    argv = ["vllm", "serve", "m", "--hf-token", "hf_secret_token", "--api-key=given-key-12345"]
    replica = Replica(0, 1, argv, {"HF_TOKEN": "hf_env_token_1", "PATH": "/usr/bin"}, None, key)
    replica.tail.extend(
        [f"ValueError: bad {key} and hf_secret_token and given-key-12345 and hf_env_token_1 in /usr/bin"]
    )
    assert replica.cause() == "ValueError: bad **** and **** and **** and **** in /usr/bin"
