"""Every model config NeMo Gym 0.7.0 ships (`responses_api_models/*/configs`) loads, or is refused in
one line per problem naming the server type or key gymproxy does not support.

The configs come from NeMo Gym's wheel, downloaded from PyPI once into ~/.cache/gymproxy/ (NeMo Gym
needs Python >= 3.13.14, so pip is told that version); without it the tests skip, saying why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gymproxy import cli
from gymproxy.config import ConfigError, load_config

VERSION = "0.7.0"
SERVED = {"vllm_model", "local_vllm_model"}  # the server types gymproxy serves
# Configs of those types that use a key gymproxy does not implement: refused by that key.
REFUSED_KEYS = {
    "vllm_model/configs/vllm_model_supply_prefix.yaml": "supply_prefix_token_ids",
    "local_vllm_model/configs/nvidia/nemotron_3_ultra_dev_nemorl_gb200.yaml": "ray_worker_py_executable",
}
VALUES = {"policy_base_url": "http://vllm:8000/v1", "policy_api_key": "k", "policy_model_name": "org/model"}
LINE = re.compile(r"^\S+\.yaml:\d+: [\w.\-/\[\]]+: \S")  # file:line: dotted.path: message


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gymproxy"


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """responses_api_models/<type>/configs/... of the wheel, by path below responses_api_models/."""
    cache = cache_dir()
    wheel = cache / f"nemo_gym-{VERSION}-py3-none-any.whl"
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", f"nemo_gym=={VERSION}"]
        command += ["--python-version", "3.13.14", "--only-binary=:all:", "-d", str(cache), "-q"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            done = None
            why = str(exc)
        if done is None or done.returncode != 0 or not wheel.exists():
            reason = why if done is None else (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            print(f"NeMo Gym {VERSION} could not be downloaded from PyPI: {reason}")
            pytest.skip(f"NeMo Gym {VERSION}'s wheel could not be downloaded from PyPI: {reason}")
    root = tmp_path_factory.mktemp("nemo_gym")
    found: dict[str, Path] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if re.fullmatch(r"responses_api_models/[^/]+/configs/.+\.yaml", name):
                path = root / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(archive.read(name))
                found[name.removeprefix("responses_api_models/")] = path
    assert len(found) >= 40, sorted(found)
    return found


def expected(name: str) -> str | None:
    """None when the config should load; else what every problem line must name."""
    kind = name.split("/")[0]
    if kind not in SERVED:
        return f"`{kind}` is not supported: "
    return REFUSED_KEYS.get(name)


def check(name: str, path: Path, environ: dict[str, str], unresolved: dict[str, str] | None) -> None:
    refused = expected(name)
    try:
        config = load_config(path, environ=environ, unresolved=unresolved)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert refused is not None, f"{name} should load: {exc}"
        assert any(refused in line for line in lines), lines
        assert all(LINE.match(line) and line.startswith(str(path)) for line in lines), lines
        return
    assert refused is None, f"{name} should be refused naming {refused}"
    assert config.launch is not None or config.base_url


def test_every_model_config_loads_or_is_refused_by_name_at_check_time(configs: dict[str, Path]) -> None:
    for name, path in sorted(configs.items()):
        check(name, path, {}, {})


def test_every_model_config_loads_or_is_refused_by_name_at_serve_time(configs: dict[str, Path]) -> None:
    for name, path in sorted(configs.items()):
        if name.endswith("nemotron_3_ultra_dev_nemorl_gb200.yaml"):
            continue  # its `model: ???` is given at serve time: the next test
        check(name, path, VALUES, None)


def test_a_required_value_is_named_at_serve_time(configs: dict[str, Path]) -> None:
    name = "local_vllm_model/configs/nvidia/nemotron_3_ultra_dev_nemorl_gb200.yaml"
    with pytest.raises(ConfigError) as error:
        load_config(configs[name], environ={})
    at = "nemotron_3_ultra_dev.responses_api_models.local_vllm_model"
    assert [line.split(": ", 2)[1] for line in str(error.value).splitlines()] == [
        f"{at}.model",
        f"{at}.ray_worker_py_executable",
    ]
    assert "is `???` (a value NeMo Gym requires)" in str(error.value)


def test_check_config_on_every_model_config(configs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for name, path in sorted(configs.items()):
        try:
            cli.main(["check-config", str(path)])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        refused = expected(name)
        if refused is None:
            assert code == 0 and out.startswith("ok: ") and err == "", (name, out, err)
        else:
            assert code == 2 and out == "" and refused in err and "Traceback" not in err, (name, err)
            assert all(line.startswith(f"gymproxy: {path}:") for line in err.splitlines()), err


def test_kimi_takes_its_checkpoint_from_the_environment(configs: dict[str, Path]) -> None:
    path = configs["local_vllm_model/configs/moonshotai/Kimi-K2.6.yaml"]
    default = load_config(path, environ={})
    given = load_config(path, environ={"KIMI_CHECKPOINT_PATH": "/ckpt/kimi"})
    assert default.launch is not None and default.launch.model == "moonshotai/Kimi-K2.6"
    assert given.launch is not None and given.launch.model == "/ckpt/kimi"
    assert given.model == "/ckpt/kimi" and "--served-model-name" in given.launch.args


def test_an_overlay_merges_over_its_base_as_in_nemo_gym(configs: dict[str, Path]) -> None:
    base = configs["vllm_model/configs/vllm_model.yaml"]
    training = configs["vllm_model/configs/vllm_model_for_training.yaml"]
    config = load_config([base, training], overrides=VALUES, environ={})
    nemo_gym = OmegaConf.merge(OmegaConf.load(base), OmegaConf.load(training), OmegaConf.create(VALUES))
    block = OmegaConf.to_container(nemo_gym, resolve=True)["policy_model"]["responses_api_models"]["vllm_model"]
    assert config.return_token_id_information is block["return_token_id_information"] is True
    assert config.request_prompt_and_generation_token_ids is block["request_prompt_and_generation_token_ids"]
    assert config.endpoint_stale_grace_s == block["endpoint_stale_grace_s"]
    assert (config.base_url, config.api_key, config.model) == ([block["base_url"]], block["api_key"], block["model"])
    overlay = configs["vllm_model/configs/vllm_model_supply_prefix.yaml"]
    with pytest.raises(ConfigError) as error:
        load_config([base, overlay], overrides=VALUES, environ={})
    assert str(error.value).splitlines() == [
        f"{overlay}:15: policy_model.responses_api_models.vllm_model.supply_prefix_token_ids: "
        "`supply_prefix_token_ids` is not supported by gymproxy (NeMo Gym's prefix-supply capture is out of "
        "gymproxy's scope)"
    ]
