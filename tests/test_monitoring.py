"""conf/monitoring: the Grafana dashboard, the ServiceMonitor and the alert rules.

The dashboard is checked against Grafana's own schema (the `Dashboard` type and the panels' option
types of `@grafana/schema`, Grafana's published TypeScript schema, compiled with `tsc`; skipped,
saying why, when they are not installed: `.ci/run` installs them) and for the structure Grafana
needs to show it; every metric a panel or an alert queries (read by a PromQL parser) must be on
the /metrics of a running gymproxy: launched fake replicas, two workers, capture and fleet control
on. The rules pass `promtool check rules` and `promtool test rules` (tests/data/monitoring), each
alert firing (Debian's `prometheus` package; skipped, saying why, without it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from .test_launch import CHAT_HI, Gym, vllm_bin, wait_until  # noqa: F401 (vllm_bin: a fixture)

ROOT = Path(__file__).parent.parent
MONITORING = ROOT / "conf" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "prometheus-rules.yaml"
RULE_TESTS = Path(__file__).parent / "data" / "monitoring" / "rules.test.yaml"
# Where `.ci/run` installs typescript and @grafana/schema (npm); GYMPROXY_GRAFANA_SCHEMA overrides it.
SCHEMA_DIR = Path(os.environ.get("GYMPROXY_GRAFANA_SCHEMA", Path.home() / ".cache" / "gymproxy" / "grafana-schema"))
# Grafana's own variables, substituted before a query is parsed as PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return [rule for group in spec["groups"] for rule in group["rules"]]


# --- the dashboard: the structure Grafana needs ------------------------------------------------


def test_the_dashboard_has_what_grafana_needs_to_show_it():
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["w"] >= 1 and grid["h"] >= 1 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels():
        assert panel["title"] and panel["description"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"]
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {v.lstrip("$") for v in GRAFANA_VARIABLES}
            assert used <= variables.keys(), f"{panel['title']}: undefined variables {used - variables.keys()}"


def test_the_dashboard_shows_what_an_operator_asked_for():
    shown = " ".join(queries())
    for metric in (
        "gymproxy_requests_total",  # throughput
        "gymproxy_upstream_completion_tokens_total",  # tokens/s
        "gymproxy_request_duration_seconds_bucket",  # p50/p99 latency by route
        "gymproxy_stream_ttfb_seconds_bucket",  # time to first byte by route
        "gymproxy_upstream_inflight",
        "gymproxy_upstream_pace_seconds",
        "gymproxy_upstream_cached_prompt_tokens_total",  # prefix-cache hit rate
        "gymproxy_pin_moves_total",
        "gymproxy_upstream_breaker",
        "gymproxy_replica_ready",
        "gymproxy_replica_starts_total",
    ):
        assert metric in shown, metric
    assert any("histogram_quantile(0.99," in q and "route" in q for q in queries())
    assert any("histogram_quantile(0.5," in q and "ttfb" in q for q in queries())


def _typescript(board: dict[str, Any]) -> str:
    """A TypeScript module that only compiles if the dashboard and each panel's options and field
    config have the types Grafana's schema gives them (object literals: no unknown keys either)."""
    types = SCHEMA_DIR / "node_modules" / "@grafana" / "schema" / "dist" / "types" / "raw"
    kinds = {"timeseries": "TimeSeries", "stat": "Stat", "state-timeline": "StateTimeline"}
    folders = {"timeseries": "timeseries", "stat": "stat", "state-timeline": "statetimeline"}
    lines = [
        f'import type {{ Dashboard }} from "{types}/dashboard/x/types.gen";',
        # JSON has an enum's value where the types name the enum (`"value"` for MappingType.ValueToText).
        "type Json<T> = T extends string ? `${T}` : T extends Array<infer U> ? Array<Json<U>>"
        " : T extends object ? { [K in keyof T]: Json<T[K]> } : T;",
    ]
    for kind, name in kinds.items():
        module = f"{types}/composable/{folders[kind]}/panelcfg/x/types.gen"
        lines.append(f'import type {{ Options as {name}Options }} from "{module}";')
    lines.append(f"export const dashboard = {json.dumps(board)} satisfies Json<Dashboard>;")
    for i, panel in enumerate(p for p in board["panels"] if p["type"] != "row"):
        name = kinds[panel["type"]]  # a panel of a type without a check here fails the test
        lines.append(f"export const options{i} = {json.dumps(panel['options'])} satisfies Json<{name}Options>;")
        assert not panel["fieldConfig"]["defaults"].get("custom"), "custom field config: add its type's check"
    return "\n".join(lines) + "\n"


def test_the_dashboard_matches_grafanas_schema(tmp_path: Path):
    tsc = SCHEMA_DIR / "node_modules" / ".bin" / "tsc"
    schema = SCHEMA_DIR / "node_modules" / "@grafana" / "schema" / "package.json"
    if not (tsc.exists() and schema.exists() and shutil.which("node")):
        reason = f"needs node, typescript and @grafana/schema under {SCHEMA_DIR} (.ci/run installs them with npm)"
        print(f"test_the_dashboard_matches_grafanas_schema: skipped because it {reason}")
        pytest.skip(reason)
    source = tmp_path / "dashboard.ts"
    source.write_text(_typescript(dashboard()))
    command = [str(tsc), "--noEmit", "--strict", "--skipLibCheck", "--target", "es2022", "--module", "es2022"]
    command += ["--moduleResolution", "node", str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # The check can fail: a key Grafana does not know, and a value of the wrong type.
    for broken in ({"panelz": []}, {"refresh": 30}):
        source.write_text(_typescript({**dashboard(), **broken}))
        assert subprocess.run(command, capture_output=True, timeout=300).returncode != 0, broken


# --- every metric queried is served -------------------------------------------------------------


def metric_names(query: str) -> set[str]:
    """The metrics a PromQL query (with Grafana's variables) reads, by its parse tree."""
    promql = pytest.importorskip("promql_parser", reason="needs promql-parser (the test extra)")
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    query = re.sub(r"\$\{?\w+\}?", ".*", query)  # a dashboard variable: any value
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            names.add(node.name)
        for field in ("expr", "lhs", "rhs", "vector_selector", "param"):
            child = getattr(node, field, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for child in getattr(node, "args", None) or []:
            walk(child)

    walk(promql.parse(query))
    assert names, f"no metric in {query}"
    return names


def families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def family_of(name: str, served: set[str]) -> str:
    if name in served:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in served:
            return name[: -len(suffix)]
    return name


def test_the_query_parser_finds_every_metric():
    found = metric_names('sum(rate(a_total{job=~"$job"}[$__rate_interval])) / on() group_left max(b) + -c offset 5m')
    assert found == {"a_total", "b", "c"}
    assert metric_names("histogram_quantile(0.5, sum by (le) (rate(d_bucket[5m]))) > bool 1") == {"d_bucket"}


def test_every_metric_the_dashboard_and_the_alerts_query_is_served(tmp_path: Path, vllm_bin: Path):  # noqa: F811
    gym = Gym(
        tmp_path,
        vllm_bin,
        "--launch-vllm",
        "tiny",
        "--replicas",
        "2",
        "--workers",
        "2",
        "--set",
        "access.fleet_control=true",
        "--set",
        "capture.enabled=true",
        "--set",
        f"capture.store=sqlite:///{tmp_path / 'rollouts.db'}",
        "--set",
        "launch.stop_grace_s=2",
    )
    try:
        gym.wait_serving()
        wait_until(lambda: all(r["state"] == "ready" for r in gym.health()["replicas"]), "both replicas ready")
        body = json.dumps({**CHAT_HI, "stream": True}).encode()
        for data in (json.dumps(CHAT_HI).encode(), body):
            request = urllib.request.Request(
                gym.url + "/v1/chat/completions", data, {"Content-Type": "application/json", "X-Rollout-ID": "r1"}
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                reply.read()
        with urllib.request.urlopen(gym.url + "/metrics", timeout=10) as reply:
            served = families(reply.read().decode())
    finally:
        gym.stop()
        gym.kill_all()
    wanted = {
        family_of(name, served): where
        for where, query in [*(("dashboard", q) for q in queries()), *((r["alert"], r["expr"]) for r in rules())]
        for name in metric_names(query)
    }
    missing = {name: where for name, where in wanted.items() if name not in served}
    assert not missing, f"queried but not on /metrics: {missing}"
    assert {"process_cpu_seconds_total", "gymproxy_build_info", "gymproxy_metrics_workers_missing"} <= served


# --- the alert rules ----------------------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "needs promtool (Debian's prometheus package; .ci/run installs it)"
        print(f"test_monitoring: skipped because it {reason}")
        pytest.skip(reason)
    return found


def test_the_alert_rules_pass_promtool_and_each_alert_fires(tmp_path: Path):
    tool = promtool()
    (tmp_path / "gymproxy-rules.yaml").write_text(yaml.safe_dump(yaml.safe_load(RULES.read_text())["spec"]))
    shutil.copy(RULE_TESTS, tmp_path / "rules.test.yaml")
    checked = subprocess.run(
        [tool, "check", "rules", "gymproxy-rules.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([tool, "test", "rules", "rules.test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Each alert has a test that fires it.
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in rules()}
    # A rule test can fail: one alert's threshold changed.
    spec = yaml.safe_load(RULES.read_text())["spec"]
    spec["groups"][0]["rules"][0]["for"] = "30m"
    (tmp_path / "gymproxy-rules.yaml").write_text(yaml.safe_dump(spec))
    assert subprocess.run([tool, "test", "rules", "rules.test.yaml"], cwd=tmp_path, capture_output=True).returncode


def test_the_alerts_say_what_is_wrong():
    for rule in rules():
        assert rule["alert"].startswith("Gymproxy") and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# --- the ServiceMonitor -------------------------------------------------------------------------


def test_the_service_monitor_scrapes_the_admin_port_of_the_example_pods():
    docs = [d for d in yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text()) if d]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    sidecar = yaml.safe_load_all((ROOT / "conf" / "deploy" / "k8s-sidecar.yaml").read_text())
    (deployment,) = [d for d in sidecar if d and d["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (proxy,) = [c for c in template["spec"]["containers"] if c["name"] == "gymproxy"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert {"containerPort": port["port"], "name": port["targetPort"]} in proxy["ports"]
    validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the test extra)")
    validate.validate(service, "1.30.0", strict=True)
    for doc in (monitor, yaml.safe_load(RULES.read_text())):
        assert {"apiVersion", "kind", "metadata", "spec"} <= doc.keys() and doc["metadata"]["name"]
