"""Config files as NeMo Gym reads them (`configfiles`): OmegaConf's loading, NeMo Gym's merge order,
Hydra-style overrides, `oc.env` from the loader's environment, and the bounds on hostile files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from gymproxy import configfiles
from gymproxy.config import ConfigError, load_config

MODEL = "policy_model.responses_api_models.vllm_model"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def nemo(tmp_path: Path, name: str, block: str, top: str = "") -> Path:
    """A NeMo Gym layout file holding one vllm_model block (indented YAML)."""
    body = textwrap.indent(textwrap.dedent(block), " " * 6)
    return write(tmp_path, name, f"{top}policy_model:\n  responses_api_models:\n    vllm_model:\n{body}")


def problems(error: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return str(error.value).splitlines()


# --- resolvers and the environment ----------------------------------------------------------------


def test_oc_env_takes_the_variable_when_set_and_the_default_when_not(tmp_path: Path) -> None:
    path = nemo(
        tmp_path,
        "c.yaml",
        """
        base_url: ${oc.env:VLLM_URL,http://default:8000/v1}
        model: ${oc.env:MODEL_NAME,moonshotai/Kimi-K2.6}
        uses_reasoning_parser: ${oc.env:REASONING,false}
        """,
    )
    unset = load_config(path, environ={})
    assert unset.base_url == ["http://default:8000/v1"] and unset.model == "moonshotai/Kimi-K2.6"
    assert unset.uses_reasoning_parser is False
    given = load_config(path, environ={"VLLM_URL": "http://set:1/v1", "MODEL_NAME": "/ckpt", "REASONING": "true"})
    assert given.base_url == ["http://set:1/v1"] and given.model == "/ckpt" and given.uses_reasoning_parser is True


def test_oc_env_reads_only_the_environment_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYMPROXY_TEST_MODEL", "from-the-process")
    path = write(tmp_path, "c.yaml", "base_url: http://h/v1\nmodel: ${oc.env:GYMPROXY_TEST_MODEL,default}\n")
    assert load_config(path, environ={}).model == "default"
    # Outside the loader, oc.env is OmegaConf's own: the process environment.
    assert OmegaConf.create({"m": "${oc.env:GYMPROXY_TEST_MODEL}"}).m == "from-the-process"


def test_an_unset_variable_without_default_names_it_or_waits_for_serve_time(tmp_path: Path) -> None:
    path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\nmodel: ${oc.env:KIMI_CHECKPOINT_PATH}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert problems(error) == [
        f"{path}:5: {MODEL}.model: uses ${{oc.env:KIMI_CHECKPOINT_PATH}}, and KIMI_CHECKPOINT_PATH is not in the "
        "environment (give the variable, or a default: ${oc.env:KIMI_CHECKPOINT_PATH,DEFAULT})"
    ]
    unresolved: dict[str, str] = {}
    load_config(path, environ={}, unresolved=unresolved)
    assert unresolved == {"oc.env:KIMI_CHECKPOINT_PATH": f"{MODEL}.model"}


def test_interpolation_and_oc_select_resolve_as_in_omegaconf(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "c.yaml",
        """
        policy_base_url: http://vllm:8000/v1
        judge_model_name: judge
        policy_model:
          responses_api_models:
            vllm_model:
              base_url: ${policy_base_url}
              model: ${oc.select:no_such_key,${judge_model_name}}
              default_headers: {X-Model: "${..model}", X-Url: "${...vllm_model.base_url}"}
              extra_body: "${oc.decode:'{top_k: 5}'}"
        """,
    )
    config = load_config(path, environ={})
    assert config.base_url == ["http://vllm:8000/v1"] and config.model == "judge"
    assert config.default_headers == {"X-Model": "judge", "X-Url": "http://vllm:8000/v1"}
    assert config.extra_body == {"top_k": 5}


def test_a_value_from_set_or_the_environment_is_never_an_interpolation(tmp_path: Path) -> None:
    """A `${` in a value given on the command line or in the environment is kept as written: it
    cannot make the loader read another variable or run a resolver."""
    path = nemo(tmp_path, "c.yaml", "base_url: ${url}\napi_key: ${key}\nmodel: m\n")
    config = load_config(path, environ={"url": "http://h/v1", "key": "${oc.env:HOME}", "HOME": "/root"})
    assert config.api_key == "${oc.env:HOME}"
    config = load_config(path, overrides={"url": "http://h/v1", "key": "k${x}"}, environ={})
    assert config.api_key == "k${x}"


def test_only_omegaconfs_own_resolvers_run(tmp_path: Path) -> None:
    """A resolver registered in the process (one that reads a file, say) is refused, never called;
    NeMo Gym's inheritance directives are refused by name."""
    calls: list[str] = []
    OmegaConf.register_new_resolver("gymproxy_test_read_file", lambda path: calls.append(path) or "secret")
    try:
        path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\napi_key: ${gymproxy_test_read_file:/etc/shadow}\n")
        with pytest.raises(ConfigError) as error:
            load_config(path, environ={})
    finally:
        OmegaConf.clear_resolver("gymproxy_test_read_file")
    assert calls == []
    assert problems(error) == [
        f"{path}:5: {MODEL}.api_key: the resolver `gymproxy_test_read_file` is not supported "
        "(only OmegaConf's: oc.create, oc.decode, oc.deprecated, oc.env, oc.select)"
    ]
    path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\nmodel: ${inherit_from:other.model}\n")
    with pytest.raises(ConfigError, match=r"vllm_model.model: `\$\{inherit_from:...\}` is NeMo Gym's inheritance"):
        load_config(path, environ={})
    path = write(
        tmp_path,
        "c.yaml",
        "policy_model:\n  _inherit_from: base\n  responses_api_models:\n    vllm_model: {base_url: http://h/v1}\n",
    )
    with pytest.raises(ConfigError, match=r"c.yaml:2: policy_model._inherit_from: `_inherit_from` is not supported"):
        load_config(path, environ={})


# --- several files, as NeMo Gym merges them -------------------------------------------------------


def test_several_files_merge_as_nemo_gym_merges_them(tmp_path: Path) -> None:
    base = nemo(
        tmp_path,
        "base.yaml",
        """
        base_url: ${policy_base_url}
        model: ${policy_model_name}
        uses_reasoning_parser: true
        extra_body: {temperature: 0.7, top_p: 0.8}
        default_headers: {X-A: a}
        """,
        top="policy_base_url: http://base:8000/v1\npolicy_model_name: base-model\n",
    )
    overlay = nemo(
        tmp_path,
        "overlay.yaml",
        """
        return_token_id_information: true
        extra_body: {temperature: 1.0}
        default_headers: {X-B: b}
        """,
        top="policy_model_name: overlay-model\n",
    )
    overrides = ["++policy_model.responses_api_models.vllm_model.extra_body.top_k=5", "+policy_base_url_unused=1"]
    files = configfiles.read([base, overlay], overrides)
    # NeMo Gym: OmegaConf.merge(*configs loaded with OmegaConf.load, the command line's config).
    command = OmegaConf.create({})
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        OmegaConf.update(command, key, int(value), force_add=True)
    nemo_gym = OmegaConf.merge(OmegaConf.load(base), OmegaConf.load(overlay), command)
    assert OmegaConf.to_container(files.tree) == OmegaConf.to_container(nemo_gym)
    config = load_config([base, overlay], hydra=overrides, environ={})
    expected = OmegaConf.to_container(nemo_gym, resolve=True)["policy_model"]["responses_api_models"]["vllm_model"]
    assert config.base_url == [expected["base_url"]] and config.model == expected["model"] == "overlay-model"
    assert config.extra_body == expected["extra_body"] == {"temperature": 1.0, "top_p": 0.8, "top_k": 5}
    assert config.default_headers == {"X-A": "a", "X-B": "b"}
    assert config.return_token_id_information and config.uses_reasoning_parser


def test_config_paths_merge_in_nemo_gyms_order(tmp_path: Path) -> None:
    """A file comes after the files it names (it wins over them); siblings in the order listed, each
    with its own files right before it. Files e, b, c, a, d here, so d wins, then a."""
    for name, includes in {"a": ["b.yaml", "c.yaml"], "b": ["e.yaml"], "c": [], "d": [], "e": []}.items():
        listed = f"config_paths: [{', '.join(str(tmp_path / i) for i in includes)}]\n" if includes else ""
        write(tmp_path, f"{name}.yaml", f"{listed}order: {name}\n{name}: true\nlast_of_a_b_c_e: {name}\n")
    files = configfiles.read([tmp_path / "a.yaml", tmp_path / "d.yaml"])
    assert [Path(path).stem for path in files.paths] == ["e", "b", "c", "a", "d"]
    assert files.tree.order == "d" and "config_paths" not in files.tree
    assert all(files.tree[name] for name in "abcde")
    # The same files, given as NeMo Gym's +config_paths override.
    via_override = configfiles.read([], [f"+config_paths=[{tmp_path / 'a.yaml'},{tmp_path / 'd.yaml'}]"])
    assert via_override.paths == files.paths


def test_problems_name_the_file_that_set_the_key(tmp_path: Path) -> None:
    base = nemo(tmp_path, "base.yaml", "base_url: http://h/v1\nport: 8000\n")
    overlay = nemo(tmp_path, "overlay.yaml", "model: m\nport: many\n")
    with pytest.raises(ConfigError) as error:
        load_config([base, overlay], environ={})
    assert problems(error) == [f"{overlay}:5: {MODEL}.port: expected `int`, got `str`"]


# --- Hydra-style overrides ------------------------------------------------------------------------


def test_overrides_as_nemo_gyms_command_line_takes_them(tmp_path: Path) -> None:
    path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\nmodel: m\ndefault_headers: {X-A: a, X-B: b}\n")
    config = load_config(
        path,
        hydra=[
            f"{MODEL}.model=plain",
            f"++{MODEL}.uses_reasoning_parser=true",
            f"+{MODEL}.extra_body={{top_k: 5, stop: [a, b]}}",
            f"~{MODEL}.default_headers.X-B",
            f"{MODEL}.chat_template_kwargs.enable_thinking=false",
        ],
        environ={},
    )
    assert config.model == "plain" and config.uses_reasoning_parser is True
    assert config.extra_body == {"top_k": 5, "stop": ["a", "b"]} and config.default_headers == {"X-A": "a"}
    assert config.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (f"{MODEL}.port=abc", f"override {MODEL}.port: expected `int`, got `str`"),
        (
            f"{MODEL}.port=[1,",
            f"override {MODEL}.port: cannot be read: no viable alternative at input '...' (Hydra's override grammar)",
        ),
        ("model=a,b", "override model: a,b is a sweep of values; quote it ('a,b'), or give a list ([a,b])"),
        ("~nope.key", "override ~nope.key: is not in the config, so it cannot be deleted"),
        ("a@pkg=1", "override a@pkg: takes key=value, +key=value, ++key=value or ~key (a dotted key)"),
        (
            f"++{MODEL}.pinning.secrte=x",
            f"override ++{MODEL}.pinning.secrte: unknown key; did you mean pinning.secret?",
        ),
    ],
)
def test_a_bad_override_is_one_line_naming_it(tmp_path: Path, override: str, line: str) -> None:
    path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, hydra=[override], environ={})
    (only,) = problems(error)
    assert only.startswith(line), only


def test_an_override_added_twice_is_refused(tmp_path: Path) -> None:
    path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\n")
    with pytest.raises(ConfigError, match=r"override \+x: is added twice"):
        load_config(path, hydra=["+x=1", "+x=2"], environ={})
    assert load_config(path, hydra=["+x=1", "++x=2"], environ={}).base_url == ["http://h/v1"]


def test_without_the_nemo_extra_an_override_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ["hydra", *(name for name in sys.modules if name.startswith("hydra."))]:
        monkeypatch.setitem(sys.modules, name, None)  # hydra-core not installed: its import fails
    path = nemo(tmp_path, "c.yaml", "base_url: http://h/v1\n")
    with pytest.raises(ConfigError, match=r"override \+x: .*pip install 'gymproxy\[nemo\]'"):
        load_config(path, hydra=["+x=1"], environ={})
    assert load_config(path, environ={}).base_url == ["http://h/v1"]


# --- hostile files: each a one-line error, in bounded time and memory ------------------------------


def billion_laughs(levels: int = 12) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(lines) + f"\nbase_url: *a{levels - 1}\n"


HOSTILE = {
    "anchor-bomb": (billion_laughs(), "has more than 20,000 values, YAML aliases expanded"),
    "self-alias": ("base_url: &a [*a]\n", "has an alias inside its own anchor (line 1)"),
    "deep-lists": ("base_url: " + "[" * 50_000 + "]" * 50_000 + "\n", "is nested more than 64 levels deep"),
    "deep-maps": ("".join(f"{'  ' * i}k{i}:\n" for i in range(70)) + "  " * 70 + "v: 1\n", "nested more than 64"),
    "many-values": ("base_url: [" + "0," * 300_000 + "0]\n", "has more than 20,000 values"),
    "huge": ("base_url: http://h/v1\n# " + "x" * (1 << 20) + "\n", "is larger than 1 MiB"),
    "cycle": ("base_url: ${model}\nmodel: ${base_url}\n", "model: interpolation cycle: base_url -> model -> base_url"),
    "self-containing": ("base_url: http://h/v1\npinning: {secret: '${pinning}'}\n", "interpolation cycle: pinning"),
    "interpolation-bomb": (
        "a0: " + "x" * 1000 + "\n" + "".join(f"a{i}: ${{a{i - 1}}}${{a{i - 1}}}\n" for i in range(1, 40)),
        "expands to more than 4,194,304 characters and values",
    ),
    "not-utf8": (b"base_url: \xff\xfe\n", "is not UTF-8 text (byte 10)"),
    "bad-yaml": ("base_url: [http://h/v1\nmodel: m\n", "is not valid YAML: expected ',' or ']'"),
    "duplicate-key": ("base_url: http://h/v1\nbase_url: http://i/v1\n", "found duplicate key base_url"),
    "a-list": ("- base_url: http://h/v1\n", "must be a mapping of config keys at the top level"),
    "two-documents": ("base_url: http://h/v1\n---\nmodel: m\n", "is not valid YAML: but found another document"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_file_is_one_line_in_bounded_memory(tmp_path: Path, name: str) -> None:
    text, needle = HOSTILE[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as error:
            load_config(path, environ={})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (only,) = problems(error)
    assert needle in only and only.startswith(str(path)), only
    assert peak < 64 << 20, f"{peak / 1e6:.0f} MB"


def test_a_hostile_file_is_one_line_from_the_command(tmp_path: Path) -> None:
    for name in ("anchor-bomb", "deep-lists", "interpolation-bomb", "cycle"):
        text, needle = HOSTILE[name]
        path = tmp_path / f"{name}.yaml"
        path.write_text(text if isinstance(text, str) else "")
        checked = subprocess.run(
            [sys.executable, "-m", "gymproxy", "check-config", str(path)], capture_output=True, text=True, timeout=120
        )
        assert checked.returncode == 2 and checked.stdout == ""
        assert checked.stderr.count("\n") == 1 and needle in checked.stderr and "Traceback" not in checked.stderr


def test_a_device_or_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^/dev/zero: is larger than 1 MiB"):
        load_config("/dev/zero", environ={})
    with pytest.raises(ConfigError, match=r"^--config: cannot read .*nope.yaml: No such file or directory$"):
        load_config(tmp_path / "nope.yaml", environ={})
    listed = write(tmp_path, "a.yaml", f"config_paths: [{tmp_path / 'gone.yaml'}]\nbase_url: http://h/v1\n")
    with pytest.raises(ConfigError, match=r"a.yaml: config_paths: cannot read .*gone.yaml"):
        load_config(listed, environ={})


def test_files_that_name_each_other_are_read_once_each(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", f"config_paths: [{tmp_path / 'b.yaml'}]\nbase_url: http://a/v1\n")
    write(tmp_path, "b.yaml", f"config_paths: [{tmp_path / 'a.yaml'}]\nmodel: b\n")
    config = load_config(tmp_path / "a.yaml", environ={})
    assert config.base_url == ["http://a/v1"] and config.model == "b"
    many = [write(tmp_path, f"m{i}.yaml", f"k{i}: 1\n") for i in range(configfiles.MAX_FILES + 1)]
    with pytest.raises(ConfigError, match="more than 64 config files"):
        load_config(many, environ={})


def test_no_message_shows_a_key(tmp_path: Path) -> None:
    secret = "sk-0123456789abcdef"
    path = nemo(tmp_path, "c.yaml", f"base_url: http://user:{secret}@h/v1\npinning: {{secret: [{secret}]}}\n")
    attempts = [
        {"hydra": [f"++{MODEL}.api_key={secret}["]},
        {"hydra": [f"++{MODEL}.api_key={secret},x"]},
        {"overrides": {"launch.args": f"--api-key '{secret}", "launch.model": "m"}},
        {},
    ]
    for attempt in attempts:
        with pytest.raises(ConfigError) as error:
            load_config(path, environ={}, **attempt)  # type: ignore[arg-type]
        assert secret not in str(error.value), str(error.value)


TOKENS = [
    "${",
    "}",
    "oc.env:",
    "oc.select:",
    "oc.decode:",
    "a",
    "b",
    "model",
    ".",
    "..",
    ",",
    ":",
    "'",
    '"',
    "\\",
    "???",
]
TOKENS += ["${a}", "${.b}", "${oc.env:X,1}", "[", "]", "{", " ", "http://h/v1", "${inherit_from:a}", "${model}"]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(values=st.lists(st.lists(st.sampled_from(TOKENS), max_size=8).map("".join), min_size=4, max_size=4))
def test_any_interpolation_loads_or_is_a_config_error(tmp_path: Path, values: list[str]) -> None:
    """Whatever a value holds, loading ends in a config or a ConfigError (one line a problem), never
    another exception: OmegaConf's own errors are caught and located."""
    layout = {"a": values[0], "b": values[1], "policy_model": {"responses_api_models": {"vllm_model": {}}}}
    layout["policy_model"]["responses_api_models"]["vllm_model"] = {"base_url": values[2], "model": values[3]}
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(layout))
    for unresolved in (None, {}):
        try:
            load_config(path, environ={"X": "x"}, unresolved=unresolved)
        except ConfigError as exc:
            assert all(line.strip() for line in str(exc).splitlines())
