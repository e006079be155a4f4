"""The deployment examples in conf/deploy parse and carry what a deployment needs (no container engine runs here)."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import yaml

from gymproxy import build_config

DEPLOY = Path(__file__).parent.parent / "conf" / "deploy"
ROOT = DEPLOY.parent.parent


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc is not None]


MANIFESTS = ["k8s-sidecar.yaml", "k8s-fleet.yaml", "k8s-launch.yaml"]
KUBERNETES = "1.30.0"  # the schemas the manifests are checked against


@pytest.mark.parametrize("name", MANIFESTS)
def test_kubernetes_examples(name: str) -> None:
    docs = documents(name)
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys() and doc["metadata"]["name"]
    config_maps = [d for d in docs if d["kind"] == "ConfigMap"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    for config_map in config_maps:
        # The embedded gymproxy config is a real, valid config.
        raw = yaml.safe_load(config_map["data"]["gymproxy.yaml"])
        if "launch" in raw:  # planned, not started: `vllm` is not on this machine
            assert raw["launch"]["model"] and raw["launch"]["replicas"] >= 1
            raw = {k: v for k, v in raw.items() if k != "launch"} | {"base_url": "http://127.0.0.1:1/v1"}
        config = build_config(raw, environ={})
        assert config.access.admin_port == 9000
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    (proxy,) = [c for c in template["spec"]["containers"] if c["name"] == "gymproxy"]
    assert proxy["args"][0] == "serve" and proxy["image"]
    # Readiness is /health (503 while no upstream is up); liveness /livez: a sidecar whose vLLM loads
    # for minutes, or a fleet with every engine down, must not get gymproxy restarted.
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/livez"
    if "startupProbe" in proxy:  # launch mode: started once a replica is ready (see below)
        assert proxy["startupProbe"]["httpGet"]["path"] == "/health"
    mounts = {m["name"] for m in proxy["volumeMounts"]}
    assert mounts <= {v["name"] for v in template["spec"]["volumes"]}
    secret = [e for e in proxy["env"] if e["name"] == "GYMPROXY_PIN_SECRET"]
    assert secret, "replicas and workers need one shared pin secret"


@pytest.mark.parametrize("name", MANIFESTS)
def test_kubernetes_examples_match_the_kubernetes_schemas(name: str) -> None:
    """Every document validates against the Kubernetes API's own schemas (`kubernetes-validate`)."""
    validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the test extra)")
    for doc in documents(name):
        validate.validate(doc, KUBERNETES, strict=True)


def test_a_launch_manifest_waits_for_its_replicas_to_load() -> None:
    """gymproxy listens at once and /health is 503 until a replica is ready: the startupProbe on
    /health holds liveness off for longer than `launch.startup_timeout_s`, so gymproxy's own
    timeout (which says why) ends a start that hangs, not the kubelet."""
    from gymproxy.config import Launch

    (config_map,) = [d for d in documents("k8s-launch.yaml") if d["kind"] == "ConfigMap"]
    (deployment,) = [d for d in documents("k8s-launch.yaml") if d["kind"] == "Deployment"]
    (proxy,) = deployment["spec"]["template"]["spec"]["containers"]
    startup = proxy["startupProbe"]
    launch = yaml.safe_load(config_map["data"]["gymproxy.yaml"])["launch"]
    timeout = launch.get("startup_timeout_s", Launch(model="m").startup_timeout_s)
    assert startup["periodSeconds"] * startup["failureThreshold"] > timeout >= 20 * 60  # big models load for minutes


def _probe(url: str, timeout: float) -> int | None:
    """One kubelet HTTP probe: the status, or None (no answer within `timeout`: a failure)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


async def test_the_sidecar_probes_keep_gymproxy_alive_while_its_vllm_loads(tmp_path: Path) -> None:
    """The sidecar's gymproxy, with its vLLM not listening yet (loading a model takes minutes), under
    the manifest's own probes, run as the kubelet runs them with their periods scaled down 60 times
    (5 minutes in 5 s): liveness never fails (no restart), readiness always does (no traffic); once
    vLLM listens, readiness passes."""
    import asyncio
    import time

    from gymproxy.testing.fake_vllm import FakeVLLM

    from .served import Served, free_port

    docs = documents("k8s-sidecar.yaml")
    raw = yaml.safe_load(docs[0]["data"]["gymproxy.yaml"])
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (proxy,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gymproxy"]
    admin, vllm = free_port(), free_port()
    ports = {raw["access"]["admin_port"]: admin}
    raw |= {"host": "127.0.0.1", "port": free_port(), "base_url": f"http://127.0.0.1:{vllm}/v1"}
    raw["access"] = {**raw["access"], "admin_port": admin}
    raw["health"] = {"interval": 0.2}
    probes = {kind: proxy[kind] for kind in ("livenessProbe", "readinessProbe")}
    scale, minutes = 60.0, 5
    async with Served(tmp_path, raw) as served:
        failures = {kind: 0 for kind in probes}
        worst = {kind: 0 for kind in probes}
        results: dict[str, list[int | None]] = {kind: [] for kind in probes}
        due = {kind: 0.0 for kind in probes}
        started = time.monotonic()
        while time.monotonic() - started < minutes * 60 / scale:
            for kind, probe in probes.items():
                if time.monotonic() < due[kind]:
                    continue
                due[kind] = time.monotonic() + probe.get("periodSeconds", 10) / scale
                get = probe["httpGet"]
                url = f"http://127.0.0.1:{ports[get['port']]}{get['path']}"
                status = await asyncio.to_thread(_probe, url, probe.get("timeoutSeconds", 1))
                results[kind].append(status)
                ok = status is not None and 200 <= status < 400
                failures[kind] = 0 if ok else failures[kind] + 1
                worst[kind] = max(worst[kind], failures[kind])
            await asyncio.sleep(0.01)
        assert served.process is not None and served.process.poll() is None
        liveness, readiness = results["livenessProbe"], results["readinessProbe"]
        assert len(liveness) >= minutes * 6 * 0.9 and set(liveness) == {200}, liveness
        assert worst["livenessProbe"] < probes["livenessProbe"].get("failureThreshold", 3)  # never restarted
        assert len(readiness) >= minutes * 12 * 0.9 and set(readiness) == {503}, readiness  # never sent traffic
        # vLLM listens at last: ready.
        fake = FakeVLLM()
        from aiohttp import web

        runner = web.AppRunner(fake.app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", vllm).start()
        try:
            deadline = time.monotonic() + 20
            get = probes["readinessProbe"]["httpGet"]
            url = f"http://127.0.0.1:{ports[get['port']]}{get['path']}"
            while await asyncio.to_thread(_probe, url, 1) != 200:
                assert time.monotonic() < deadline, "readiness did not pass once vLLM listened"
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()


def test_sidecar_reaches_vllm_on_localhost() -> None:
    docs = documents("k8s-sidecar.yaml")
    config = build_config(yaml.safe_load(docs[0]["data"]["gymproxy.yaml"]), environ={})
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (vllm,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    port = vllm["ports"][0]["containerPort"]
    assert config.base_url == [f"http://127.0.0.1:{port}/v1"]


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment]
    unit.read_string((DEPLOY / "gymproxy.service").read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    assert "gymproxy serve --config" in service["ExecStart"]
    assert service["KillSignal"] == "SIGTERM" and int(service["LimitNOFILE"]) >= 65536
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_dockerfile() -> None:
    lines = [
        line.strip()
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0].startswith("FROM python:3.")
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
    assert 'ENTRYPOINT ["gymproxy"]' in lines
    assert any(line.startswith("HEALTHCHECK") and "/livez" in line for line in lines)  # liveness, not readiness
    assert 'CMD ["serve", "--config", "/etc/gymproxy/gymproxy.yaml"]' in lines  # never the demo on 0.0.0.0


def test_the_demo_refuses_a_public_host(tmp_path: Path) -> None:
    """With no upstream, `gymproxy serve` runs its bundled fake vLLM: only on a loopback host."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "gymproxy", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert run.returncode == 2 and "only on a loopback host" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
