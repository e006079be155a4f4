"""gymproxy.metrics and gymproxy.peers: one scrape that covers every worker of `serve --workers N`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gymproxy.metrics import Metrics, merge, number
from gymproxy.peers import Peers


def _worker(requests: int, inflight: int, healthy: int, slow: float) -> str:
    metrics = Metrics()
    metrics.requests[("/v1/responses", 200)] = requests
    metrics.upstream_requests[("a", 200)] = requests
    for _ in range(requests):
        metrics.duration.observe("/v1/responses", slow)
    gauges = [
        ("gymproxy_upstream_inflight", "gauge", "In flight.", lambda: [('{upstream="a"}', inflight)]),
        ("gymproxy_upstream_healthy", "gauge", "Healthy.", lambda: [('{upstream="a"}', healthy)]),
        ("gymproxy_pins_created_total", "counter", "Pins.", lambda: [("", requests)]),
    ]
    return metrics.render(gauges)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, as prometheus_client's parser reads the text (which also checks it is valid)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_and_histograms_add_up_and_gauges_keep_their_worker():
    merged = _samples(merge([_worker(7, 1, 1, 0.02), _worker(13, 2, 0, 3.0)]))
    assert merged[("gymproxy_requests_total", (("route", "/v1/responses"), ("status", "200")))] == 20
    assert merged[("gymproxy_upstream_requests_total", (("status", "200"), ("upstream", "a")))] == 20
    assert merged[("gymproxy_pins_created_total", ())] == 20
    route = (("route", "/v1/responses"),)
    assert merged[("gymproxy_request_duration_seconds_count", route)] == 20
    assert merged[("gymproxy_request_duration_seconds_bucket", (("le", "0.025"), *route))] == 7
    assert merged[("gymproxy_request_duration_seconds_bucket", (("le", "+Inf"), *route))] == 20
    assert merged[("gymproxy_request_duration_seconds_sum", route)] == pytest.approx(7 * 0.02 + 13 * 3.0)
    assert merged[("gymproxy_upstream_inflight", (("upstream", "a"),))] == 3  # summed: the server's total
    healthy = "gymproxy_upstream_healthy"
    assert merged[(healthy, (("upstream", "a"), ("worker", "0")))] == 1  # each worker's own view
    assert merged[(healthy, (("upstream", "a"), ("worker", "1")))] == 0
    assert merged[("gymproxy_metrics_workers", ())] == 2
    assert merged[("gymproxy_metrics_workers_missing", ())] == 0


def test_a_missing_worker_is_named_and_left_out():
    merged = _samples(merge([_worker(7, 0, 1, 0.1), None, _worker(5, 0, 1, 0.1)]))
    assert merged[("gymproxy_requests_total", (("route", "/v1/responses"), ("status", "200")))] == 12
    assert merged[("gymproxy_metrics_workers", ())] == 3
    assert merged[("gymproxy_metrics_workers_missing", ())] == 1
    assert merged[("gymproxy_metrics_worker_up", (("worker", "1"),))] == 0
    assert merged[("gymproxy_metrics_worker_up", (("worker", "2"),))] == 1


def test_the_replicas_the_parent_runs_are_counted_once_not_once_per_worker():
    """Every worker repeats the launched replicas' states its parent writes: a restart is one."""
    replicas = [
        ("gymproxy_replica_ready", "gauge", "Ready.", lambda: [('{replica="vllm-0"}', 1)]),
        ("gymproxy_replica_starts_total", "counter", "Starts.", lambda: [('{replica="vllm-0"}', 2)]),
    ]
    merged = _samples(merge([Metrics().render(replicas), Metrics().render(replicas), None]))
    assert merged[("gymproxy_replica_starts_total", (("replica", "vllm-0"),))] == 2
    assert merged[("gymproxy_replica_ready", (("replica", "vllm-0"),))] == 1


def test_values_are_exact():
    assert number(1234567) == "1234567" and number(3.0) == "3" and number(0.25) == "0.25"
    metrics = Metrics()
    metrics.requests[("/x", 200)] = 10**7 + 1
    for _ in range(3):
        metrics.duration.observe("/x", 0.1)
    text = metrics.render([("g", "gauge", "G.", lambda: [("", 2_000_001)])])
    assert "g 2000001" in text and 'gymproxy_request_duration_seconds_count{route="/x"} 3' in text
    assert _samples(merge([text, text]))[("gymproxy_requests_total", (("route", "/x"), ("status", "200")))] == 2e7 + 2


async def test_peers_merge_their_siblings_and_skip_a_stuck_one(tmp_path: Path):
    """Worker 0 answers a scrape with worker 1's numbers; worker 2 accepts but never answers, and
    the scrape is late only by the timeout."""
    directory = str(tmp_path)
    zero, one = Peers(directory, 0, 3, timeout=0.3), Peers(directory, 1, 3, timeout=0.3)
    await one.serve(lambda: _worker(13, 0, 1, 0.1))

    held: list[asyncio.StreamWriter] = []

    async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, and never answered

    hung = await asyncio.start_unix_server(stuck, zero.path(2))
    try:
        started = time.monotonic()
        merged = _samples(await zero.collect(_worker(7, 0, 1, 0.1)))
        assert time.monotonic() - started < 2
    finally:
        for writer in held:
            writer.close()
        hung.close()
        await hung.wait_closed()
        await one.close()
    assert merged[("gymproxy_requests_total", (("route", "/v1/responses"), ("status", "200")))] == 20
    assert merged[("gymproxy_metrics_workers_missing", ())] == 1
    assert merged[("gymproxy_metrics_worker_up", (("worker", "2"),))] == 0
    assert not Path(one.path(1)).exists()


async def test_the_operators_series_are_scraped_from_gymproxy_serve(fake_vllm, tmp_path):
    """`gymproxy serve`'s /metrics has what a dashboard needs beside the request counts: generated
    tokens (tokens/s) and reply time by upstream, the breaker as a labelled state, open client
    connections, build info and the process's own `process_*` series; and it all parses."""
    import aiohttp

    from .served import Served

    async with Served(tmp_path, {"base_url": fake_vllm.url}) as served:
        async with aiohttp.ClientSession() as session:
            async with session.post(served.url + "/v1/responses", json={"model": "m", "input": "hi there"}) as r:
                assert r.status == 200
            async with session.get(served.url + "/metrics") as r:
                text = await r.text()
    samples = _samples(text)
    name = fake_vllm.url
    assert samples[("gymproxy_upstream_completion_tokens_total", (("upstream", name),))] > 0
    assert samples[("gymproxy_upstream_duration_seconds_count", (("upstream", name),))] == 1
    assert samples[("gymproxy_upstream_breaker_state", (("state", "closed"), ("upstream", name)))] == 1
    assert samples[("gymproxy_upstream_breaker_state", (("state", "open"), ("upstream", name)))] == 0
    assert samples[("gymproxy_client_connections", ())] >= 1  # this scrape's own connection
    assert any(key[0] == "gymproxy_build_info" and dict(key[1])["version"] for key in samples)
    assert samples[("process_cpu_seconds_total", ())] > 0 and samples[("process_open_fds", ())] > 0
