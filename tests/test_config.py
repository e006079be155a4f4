"""Config loading: both layouts, placeholders, unknown keys, every file in conf/, and the CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gymproxy.config import Config, ConfigError, build_config, load_config

CONF = Path(__file__).parent.parent / "conf"
NEMO = """
policy_model:
  responses_api_models:
    vllm_model:
      entrypoint: app.py
      num_workers: 8
      base_url: ${policy_base_url}
      api_key: ${policy_api_key}
      model: ${policy_model_name}
      return_token_id_information: false
      uses_reasoning_parser: true
      uses_interleaved_reasoning: true
      chat_template_kwargs: null
      extra_body: null
      default_headers: {}
"""
VALUES = {"policy_base_url": "http://vllm:8000/v1", "policy_api_key": "k", "policy_model_name": "Qwen/Qwen3-8B"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    # Only the file's own placeholders: any other --set name is a config key, and these are none.
    values = {name: value for name, value in VALUES.items() if f"${{{name}}}" in path.read_text()}
    config = load_config(path, overrides=values, environ={})
    assert isinstance(config, Config)
    assert config.base_url == ["http://vllm:8000/v1"]


def test_nemo_layout_keeps_names_and_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, NEMO), overrides=VALUES, environ={})
    assert config.name == "policy_model"
    assert config.model == "Qwen/Qwen3-8B" and config.api_key == "k"
    assert config.uses_reasoning_parser is True and config.uses_interleaved_reasoning is True
    assert config.reasoning_field == "both"
    assert config.num_workers == 8 and config.entrypoint == "app.py"
    assert config.propagate_context_overflow_errors is False
    assert config.sequential_reasoning_allowed is True


def test_placeholders_come_from_set_then_environment(tmp_path: Path) -> None:
    env = {**VALUES, "policy_model_name": "from-env"}
    config = load_config(write(tmp_path, NEMO), overrides={"policy_model_name": "from-set"}, environ=env)
    assert config.model == "from-set"
    config = load_config(write(tmp_path, NEMO), environ=env)
    assert config.model == "from-env"


def test_unresolved_placeholder_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$\{policy_api_key\}"):
        load_config(
            write(tmp_path, NEMO), overrides={"policy_base_url": "http://x/v1", "policy_model_name": "m"}, environ={}
        )


def test_list_of_base_urls_from_a_placeholder(tmp_path: Path) -> None:
    values = {**VALUES, "policy_base_url": "[http://a:1/v1, http://b:2/v1]"}
    config = load_config(write(tmp_path, NEMO), overrides=values, environ={})
    assert config.base_url == ["http://a:1/v1", "http://b:2/v1"]


def test_unknown_key_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="raed"):
        load_config(write(tmp_path, "base_url: http://x/v1\ntimeouts:\n  raed: 5\n"), environ={})
    with pytest.raises(ConfigError, match="uses_reasoning_parsr"):
        load_config(write(tmp_path, "base_url: http://x/v1\nuses_reasoning_parsr: true\n"), environ={})


def test_several_servers_need_a_choice(tmp_path: Path) -> None:
    text = NEMO + NEMO.replace("policy_model:", "judge_model:")
    with pytest.raises(ConfigError, match="--server"):
        load_config(write(tmp_path, text), overrides=VALUES, environ={})
    assert load_config(write(tmp_path, text), overrides=VALUES, environ={}, server="judge_model").name == "judge_model"


def test_set_overrides_a_key_and_converts_its_type(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, NEMO), overrides={**VALUES, "uses_reasoning_parser": "false", "port": "9001"}, environ={}
    )
    assert config.uses_reasoning_parser is False and config.port == 9001


def test_set_reaches_nested_keys(tmp_path: Path) -> None:
    sets = {
        "pinning.secret": "x",
        "limits.max_client_connections": "100",
        "timeouts.read": "30",
        "default_headers.X-Team": "rl",
        "access.api_keys": "[a, b]",
    }
    config = load_config(
        write(tmp_path, "base_url: http://u/v1\npinning: {cookie_name: c}\n"), overrides=sets, environ={}
    )
    assert config.pinning.secret == "x" and config.pinning.cookie_name == "c"  # the file's other keys stay
    assert config.limits.max_client_connections == 100 and config.timeouts.read == 30.0
    assert config.default_headers == {"X-Team": "rl"} and config.access.api_keys == ["a", "b"]
    with_secret = load_config(
        None, overrides={"pinning.secret": "123"}, extra={"base_url": ["http://u/v1"]}, environ={}
    )
    assert with_secret.pinning.secret == "123"  # a string key keeps its digits as a string


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("pinning.secrte", "--set pinning.secrte: unknown key; did you mean pinning.secret?"),
        ("timeoust.read", "--set timeoust.read: unknown key; did you mean timeouts?"),
        ("bogus", "--set bogus: unknown key; the config has "),
        ("pinning.secret.deeper", "--set pinning.secret.deeper: `pinning.secret` is not a section"),
    ],
)
def test_set_of_an_unknown_key_is_an_error_naming_it(tmp_path: Path, name: str, needle: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, "base_url: http://u/v1\n"), overrides={name: "1"}, environ={})
    assert needle in str(error.value)


def test_set_of_a_placeholder_still_resolves_it(tmp_path: Path) -> None:
    """A --set name the file uses as ${name} keeps that meaning, even when it is a key's name too."""
    config = load_config(
        write(tmp_path, "base_url: http://u/v1\nmodel: ${port}\n"), overrides={"port": "m"}, environ={}
    )
    assert config.model == "m" and config.port == 8000


def test_cli_set_nested_and_misspelt(tmp_path: Path) -> None:
    text = "base_url: ${url}\n"
    good = _check_config(str(write(tmp_path, text)), "--set=pinning.secret=x", "--set=timeouts.read=30")
    assert good.returncode == 0, good.stderr
    assert "${url} (base_url)" in good.stdout  # placeholders are still listed as given at serve time
    bad = _check_config(str(write(tmp_path, text)), "--set=pinning.secrte=x")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "gymproxy: --set pinning.secrte: unknown key; did you mean pinning.secret?"
    serve = subprocess.run(
        [
            sys.executable,
            "-m",
            "gymproxy",
            "serve",
            "--upstream",
            "http://u/v1",
            "--set",
            "limits.max_client_conections=9",
        ],
        capture_output=True,
        text=True,
    )
    assert serve.returncode == 2 and "limits.max_client_conections: unknown key" in serve.stderr


def test_reasoning_field_from_environment() -> None:
    assert (
        build_config({"base_url": "http://x/v1"}, environ={"NEMO_GYM_REASONING_FIELD": " reasoning "}).reasoning_field
        == "reasoning"
    )
    with pytest.raises(ConfigError, match="NEMO_GYM_REASONING_FIELD"):
        build_config({"base_url": "http://x/v1"}, environ={"NEMO_GYM_REASONING_FIELD": "nope"})
    with pytest.raises(ConfigError, match="reasoning_field"):
        build_config({"base_url": "http://x/v1", "reasoning_field": "nope"}, environ={})


@pytest.mark.parametrize(
    "section, needle",
    [
        ({"base_url": []}, "base_url"),
        ({"base_url": "vllm:8000/v1"}, "http://"),
        ({"base_url": "http://x/v1", "endpoint_file": "/tmp/url"}, "endpoint_file"),
        ({"base_url": "http://x/v1", "port": 70000}, "port"),
        ({"base_url": "http://x/v1", "timeouts": {"connect": 0}}, "connect"),
        ({}, "base_url"),
    ],
)
def test_invalid_values(section: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_config(section, environ={})


@pytest.mark.parametrize(
    "upstream, needle",
    [
        ({"url": "http://127.0.0.1:99999/v1"}, r"upstreams\[0\]: url .*Port out of range"),
        ({"url": "http://[zz::1]/v1"}, r"upstreams\[0\]: url .*not an IPv6 address"),
        ({"url": "http:///v1"}, r"upstreams\[0\]: url .*has no host"),
        ({"url": "file:///etc/passwd"}, r"upstreams\[0\]: url .*must start with http"),
        ({"url": "http://user:secret@h:0/v1"}, r"upstreams\[0\]: url 'http://h:0/v1': port 0 is out of range"),
        ({"url": "http://h/v1", "name": "x" * 300}, r"upstreams\[0\]: name must be 1 to 256"),
        ({"url": "http://h/v1", "name": "a b"}, r"upstreams\[0\]: name"),
        ({"url": "http://h/v1", "api_key": "k\r\nX: 1"}, r"upstreams\[0\]: api_key"),
        ({"url": "http://h/v1", "weight": float("nan")}, r"upstreams\[0\]: weight .* got nan"),
        ({"url": "http://h/v1", "weight": float("inf")}, r"upstreams\[0\]: weight"),
        ({"url": "http://h/v1", "weight": 1001}, r"upstreams\[0\]: weight must be above 0 and at most 1000"),
        ({"url": "http://h/v1", "weight": 0}, r"upstreams\[0\]: weight"),
        ({"url": "http://127.0.0.1:8/v1#frag"}, r"upstreams\[0\]: url 'http://127.0.0.1:8/v1#frag' has a fragment"),
        ({"url": "http://h/v1#"}, r"upstreams\[0\]: url .* has a fragment"),
        ({"url": "http://h/v1?api-version=1"}, r"upstreams\[0\]: url .* has a query string: .*default_query"),
        ({"url": "http://h/v1?"}, r"upstreams\[0\]: url .* has a query string"),
    ],
)
def test_an_upstream_that_cannot_be_built_is_an_error_naming_it(upstream: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as caught:
        build_config({"upstreams": [upstream]}, environ={})
    assert "secret" not in str(caught.value)  # a URL's credentials are never shown


def test_base_url_and_api_key_are_checked_like_any_upstream() -> None:
    with pytest.raises(ConfigError, match=r"base_url\[1\]: url .*Port out of range"):
        build_config({"base_url": ["http://a/v1", "http://b:65536/v1"]}, environ={})
    with pytest.raises(ConfigError, match="api_key must be at most 4096 visible ASCII"):
        build_config({"base_url": "http://a/v1", "api_key": "sk\nX-Injected: 1"}, environ={})
    ok = build_config(
        {"base_url": ["http://[::1]:8000/v1", "https://vllm-0.vllm.ns.svc:443/v1/"], "api_key": "sk-1"}, environ={}
    )
    assert len(ok.base_url) == 2


@pytest.mark.parametrize(
    ("keys", "lines", "needle"),
    [
        ([""], None, r"access.api_keys\[0\]: is empty: no client can send an empty key"),
        (["k1", "   "], None, r"access.api_keys\[1\]: is empty"),
        (["k 1"], None, r"access.api_keys\[0\]: must be at most 4096 visible ASCII"),
        (["k\r\nX: 1"], None, r"access.api_keys\[0\]: must be at most 4096 visible ASCII"),
        (["k" * 5000], None, r"access.api_keys\[0\]: must be at most 4096"),
        ([], "# keys\nk1\nk 2\n", r"access.api_keys_file: .*keys, line 3, must be at most 4096 visible ASCII"),
    ],
)
def test_an_inbound_key_no_client_can_send_is_an_error_naming_it(tmp_path: Path, keys, lines, needle) -> None:
    """An empty key (or one of spaces) started and refused every request with a 401, saying nothing."""
    access: dict[str, object] = {"api_keys": keys}
    if lines is not None:
        (tmp_path / "keys").write_text(lines)
        access["api_keys_file"] = str(tmp_path / "keys")
    with pytest.raises(ConfigError, match=needle):
        build_config({"base_url": "http://a/v1", "access": access}, environ={})


def test_an_empty_inbound_key_stops_startup_in_one_line(tmp_path: Path) -> None:
    config = write(tmp_path, "base_url: http://a/v1\naccess:\n  api_keys: ['']\n")
    result = subprocess.run(
        [sys.executable, "-m", "gymproxy", "check-config", str(config)], capture_output=True, text=True
    )
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"gymproxy: {config}:") and line.endswith(
        "access.api_keys[0]: is empty: no client can send an empty key, so every request would be refused (401); "
        "remove it, or give the key"
    ), line


def test_open_admin_changes_need_a_loopback_host_and_admin_requires_key_needs_keys(tmp_path: Path) -> None:
    changes = {"admin_fleet_changes": True}
    for host in ("0.0.0.0", "::", "10.0.0.5", "vllm-proxy.example"):
        with pytest.raises(ConfigError, match="access.admin_fleet_changes: with no access.api_keys .* loopback host"):
            build_config({"base_url": "http://x/v1", "host": host, "access": changes}, environ={})
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        build_config({"base_url": "http://x/v1", "host": host, "access": changes}, environ={})
    keys = tmp_path / "keys"
    keys.write_text("# the admins\nk1\n")
    for access in ({"api_keys": ["k"]}, {"api_keys_file": str(keys)}):
        build_config({"base_url": "http://x/v1", "host": "0.0.0.0", "access": {**changes, **access}}, environ={})
    with pytest.raises(ConfigError, match="access.admin_requires_key: needs access.api_keys"):
        build_config({"base_url": "http://x/v1", "access": {"admin_requires_key": True}}, environ={})
    build_config({"base_url": "http://x/v1", "access": {"admin_requires_key": True, "api_keys_file": str(keys)}})


def test_cli_check_config(tmp_path: Path) -> None:
    good = subprocess.run(
        [
            sys.executable,
            "-m",
            "gymproxy",
            "check-config",
            str(CONF / "vllm_model.yaml"),
            *[f"--set={k}={v}" for k, v in VALUES.items()],
        ],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stderr
    assert "http://vllm:8000/v1" in good.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gymproxy", "check-config", str(write(tmp_path, "base_url: http://x/v1\nbogus: 1\n"))],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "bogus" in bad.stderr


def _check_config(*args: str) -> subprocess.CompletedProcess[str]:
    # A clean environment: no placeholder may be resolved from the developer's shell.
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "gymproxy", "check-config", *args], capture_output=True, text=True, env=env
    )


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.name)
def test_check_config_passes_every_shipped_config_as_shipped(path: Path) -> None:
    checked = _check_config(str(path))
    assert checked.returncode == 0, checked.stderr
    assert "given at serve time" in checked.stdout and "${policy_base_url}" in checked.stdout


def test_check_config_lists_placeholders_given_at_serve_time(tmp_path: Path) -> None:
    text = "base_url: ${url}\nport: ${port}\naccess_log: ${log}\nshutdown_grace_s: ${grace}\n"
    text += "pinning: {secret: '${secret}', cookie_name: 'gp-${suffix}'}\n"
    checked = _check_config(str(write(tmp_path, text)))
    assert checked.returncode == 0, checked.stderr
    first, second = checked.stdout.splitlines()
    assert first.startswith("ok: 1 upstream(s): ${url}")
    for name, where in [("url", "base_url"), ("port", "port"), ("secret", "pinning.secret"), ("suffix", "pinning")]:
        assert f"${{{name}}} ({where}" in second
    # Given values are used as at serve time, and checked.
    assert "${port}" not in _check_config(str(write(tmp_path, text)), "--set=port=9000").stdout
    bad = _check_config(str(write(tmp_path, text)), "--set=port=many")
    assert bad.returncode == 2 and "port" in bad.stderr


def test_check_config_takes_placeholders_in_an_upstreams_checked_keys(tmp_path: Path) -> None:
    text = "upstreams:\n- {url: '${a_url}', name: '${a_name}', api_key: '${a_key}'}\n"
    text += "- {url: 'http://b/v1', name: '${b_name}'}\n"
    checked = _check_config(str(write(tmp_path, text)))
    assert checked.returncode == 0, checked.stderr


def test_check_config_still_refuses_what_is_wrong_beside_placeholders(tmp_path: Path) -> None:
    checked = _check_config(str(write(tmp_path, "base_url: ${url}\nbogus: 1\n")))
    assert checked.returncode == 2 and "bogus" in checked.stderr
    checked = _check_config(str(write(tmp_path, "base_url: ${url}\nport: nine\n")))
    assert checked.returncode == 2 and "port" in checked.stderr


def test_check_config_strict_makes_placeholders_errors() -> None:
    checked = _check_config("--strict", str(CONF / "vllm_model.yaml"))
    assert checked.returncode == 2
    assert "policy_base_url" in checked.stderr and "--set" in checked.stderr


def test_serve_still_needs_every_placeholder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$\{url\}"):
        load_config(write(tmp_path, "base_url: ${url}\n"), environ={})


def test_the_reference_config_lists_every_option_with_its_default():
    """conf/gymproxy.yaml is the documentation of every key: each one, at its default."""
    import msgspec
    import yaml

    from gymproxy.config import Config

    listed = yaml.safe_load((Path(__file__).parent.parent / "conf" / "gymproxy.yaml").read_text())
    defaults = msgspec.to_builtins(Config(base_url=["http://vllm/v1"]))

    def walk(have: dict, want: dict, where: str) -> None:
        assert set(have) == set(want), (where, sorted(set(want) ^ set(have)))
        for key, value in want.items():
            if isinstance(value, dict) and value and isinstance(have[key], dict):
                walk(have[key], value, f"{where}{key}.")
            elif key not in ("base_url",):
                assert have[key] == value or (key == "reasoning_field" and have[key] is None), (where + key, have[key])

    walk(listed, defaults, "")


def test_session_headers_and_the_older_single_header_key() -> None:
    default = build_config({"base_url": "http://x/v1"}, environ={})
    assert default.pinning.session_headers == ["X-Session-ID", "session-id", "X-Claude-Code-Session-Id"]
    assert default.anthropic_messages is True
    old = build_config({"base_url": "http://x/v1", "pinning": {"session_header": "X-Rollout"}}, environ={})
    assert old.pinning.session_headers == ["X-Rollout"]
    new = build_config({"base_url": "http://x/v1", "pinning": {"session_headers": ["A", "B"]}}, environ={})
    assert new.pinning.session_headers == ["A", "B"]
    with pytest.raises(ConfigError, match="not both"):
        build_config({"base_url": "http://x/v1", "pinning": {"session_header": "A", "session_headers": ["B"]}})
    with pytest.raises(ConfigError, match=r"session_headers\[0\]"):
        build_config({"base_url": "http://x/v1", "pinning": {"session_headers": ["no spaces"]}}, environ={})


# --- every problem at once, at its file and line (#24) ---------------------------------------------

THREE_MISTAKES = """\
policy_model:
  responses_api_models:
    vllm_model:
      base_url: http://vllm:8000/v1
      uses_reasoning_parsr: true
      pinning:
        secrte: x
      reasoning_field: reasoning-content
"""


def test_three_mistakes_are_three_errors_at_their_lines_with_a_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, THREE_MISTAKES)
    at = "policy_model.responses_api_models.vllm_model"
    expected = [
        f"{path}:5: {at}.uses_reasoning_parsr: unknown key; did you mean uses_reasoning_parser?",
        f"{path}:7: {at}.pinning.secrte: unknown key; did you mean pinning.secret?",
        f"{path}:8: {at}.reasoning_field: is 'reasoning-content'; the allowed values are both, reasoning, "
        "reasoning_content",
    ]
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert str(error.value).splitlines() == expected
    for command in (["check-config", str(path)], ["serve", "--config", str(path)]):
        done = subprocess.run([sys.executable, "-m", "gymproxy", *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.splitlines() == [f"gymproxy: {line}" for line in expected]


def test_the_flat_layout_is_located_too(tmp_path: Path) -> None:
    path = write(tmp_path, "base_url: [http://a/v1, 'http://b:99999/v1']\ntimeouts:\n  raed: 5\nport: nine\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert str(error.value).splitlines() == [
        f"{path}:3: timeouts.raed: unknown key; did you mean timeouts.read?",
        f"{path}:4: port: expected `int`, got `str`",
        f"{path}:1: base_url[1]: url 'http://b:99999/v1' cannot be used: Port out of range 0-65535",
    ]


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_an_empty_file_says_so(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    checked = _check_config(str(path))
    assert checked.returncode == 2
    assert checked.stderr == f"gymproxy: {path}: is empty: give it config keys (a mapping), or leave it out\n"


def test_a_base_url_without_v1_is_a_warning(tmp_path: Path) -> None:
    path = write(tmp_path, "base_url: [http://a:8000/v1, http://b:8000]\nupstreams: [{url: 'http://c/v1/'}]\n")
    checked = _check_config(str(path))
    assert checked.returncode == 0 and checked.stdout.startswith("ok: 3 upstream(s)")
    assert checked.stderr.splitlines() == [
        f"gymproxy: warning: {path}:1: base_url[1]: 'http://b:8000' does not end in /v1: gymproxy sends requests "
        "to <base_url>/chat/completions, and vLLM serves /v1/chat/completions"
    ]
    warnings: list[str] = []
    load_config(path, environ={}, warnings=warnings)
    assert len(warnings) == 1 and "base_url[1]" in warnings[0]


def test_check_config_help_documents_the_exit_status() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "gymproxy", "check-config", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0
    assert "exit status:" in shown.stdout and "  2  the config or the command line is wrong" in shown.stdout


def test_serve_and_check_config_take_several_files_and_overrides(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(NEMO)
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        "policy_model:\n  responses_api_models:\n    vllm_model:\n      return_token_id_information: true\n"
    )
    values = [f"+{name}={value}" for name, value in VALUES.items()]
    checked = _check_config(str(base), str(overlay), *values)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout == "ok: 1 upstream(s): http://vllm:8000/v1; model Qwen/Qwen3-8B\n"
    config = load_config([base, overlay], hydra=values, environ={})
    assert config.return_token_id_information is True and config.api_key == "k"


def test_a_reload_reads_every_file_and_override_again(tmp_path: Path) -> None:
    """SIGHUP re-reads the config as serve first read it: the same files, overrides and --set pairs."""
    from gymproxy.cli import Loader

    base = tmp_path / "base.yaml"
    base.write_text("base_url: http://a/v1\n")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model: m1\n")
    reload = Loader([str(base), str(overlay)], {"pinning.secret": "s"}, None, {}, ["++port=9001"])
    first = reload()
    assert (first.base_url, first.model, first.port, first.pinning.secret) == (["http://a/v1"], "m1", 9001, "s")
    overlay.write_text("model: m2\nbase_url: [http://a/v1, http://b/v1]\n")
    second = reload()
    assert second.model == "m2" and second.base_url == ["http://a/v1", "http://b/v1"] and second.port == 9001
    overlay.write_text("model: m3\nbogus: 1\n")
    with pytest.raises(ConfigError, match="overlay.yaml:2: bogus: unknown key"):
        reload()


def _migration_command() -> str:
    """The command of the README's "From NeMo Gym's `vllm_model` server" paragraph, as written."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Coming from NeMo Gym") :]
    paragraph = " ".join(section[section.index("**From NeMo Gym's `vllm_model` server.**") :].split("\n\n")[0].split())
    return paragraph.split("Run `", 1)[1].split("`", 1)[0]


@pytest.mark.parametrize("by", ["--set", "environment"])
async def test_the_readme_migration_instructions_work_verbatim(tmp_path: Path, fake_vllm, by: str) -> None:
    """`gymproxy serve --config <your vllm_model.yaml> --set policy_base_url=... ...` (or export those
    variables), with NeMo Gym's own vllm_model.yaml, serves a chat through to vLLM."""
    import aiohttp

    from .served import free_port

    command = _migration_command()
    assert command == (
        "gymproxy serve --config <your vllm_model.yaml> --set policy_base_url=... --set policy_api_key=... "
        "--set policy_model_name=..."
    )
    values = {"policy_base_url": fake_vllm.url, "policy_api_key": "EMPTY", "policy_model_name": "Qwen/Qwen3-8B"}
    words = command.replace("<your vllm_model.yaml>", str(CONF / "vllm_model.yaml")).split()
    env = {"PATH": os.environ["PATH"]}
    if by == "--set":
        words = [f"{w.partition('=')[0]}={values[w.partition('=')[0]]}" if w.endswith("=...") else w for w in words]
    else:  # "or export those variables"
        words = [w for w in words if not w.endswith("=...") and w != "--set"]
        env |= values
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "gymproxy", *words[1:], "--port", str(port)], stdout=output, stderr=output, env=env
        )
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as health:
                        if health.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                assert process.poll() is None, log.read_text()
                await asyncio.sleep(0.05)
            body = {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["model"] == "Qwen/Qwen3-8B"
    finally:
        process.terminate()  # its 8 workers (num_workers: 8) drain; on a loaded machine that takes a while
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError(f"gymproxy serve did not stop on SIGTERM:\n{log.read_text()[-3000:]}") from None


def test_overrides_and_files_may_sit_among_the_options() -> None:
    from gymproxy.cli import _arguments, _parser

    parser = _parser()
    args = _arguments(parser, ["serve", "--config", "a.yaml", "+x=1", "--port", "9000", "++y=2", "~z"])
    assert (args.config, args.overrides, args.port) == (["a.yaml"], ["+x=1", "++y=2", "~z"], 9000)
    args = _arguments(parser, ["check-config", "a.yaml", "--set", "q=1", "b.yaml", "k=v"])
    assert (args.items, args.set) == (["a.yaml", "b.yaml", "k=v"], ["q=1"])
    for argv in (["serve", "--port", "1", "a.yaml"], ["serve", "--bogus"], ["check-config", "a.yaml", "--bogus"]):
        with pytest.raises(SystemExit) as exited:
            _arguments(parser, argv)
        assert exited.value.code == 2
