"""The deployable service in workers/: settings from the environment, ``python -m workers``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workers.settings import load  # noqa: E402


def test_settings_from_environment() -> None:
    settings = load(
        {
            "ASYNCGRAPH_REDIS_URL": "rediss://u:p@redis:6380/1",
            "ASYNCGRAPH_IMPORTS": "a.b, c",
            "ASYNCGRAPH_PROCESSES": "4",
            "ASYNCGRAPH_HEALTH_PORT": "",
            "ASYNCGRAPH_SECRET": "x" * 32,
            "ASYNCGRAPH_ALLOWED_BASE_URLS": "http://vllm:8000/v1, https://llm.example/v1",
        }
    )
    assert settings.imports == ("a.b", "c") and settings.processes == 4
    assert settings.allowed_base_urls == ("http://vllm:8000/v1", "https://llm.example/v1")
    assert settings.health_port is None  # "" turns it off; unset, it is the service's 9100
    assert load({"ASYNCGRAPH_REDIS_URL": "redis://r"}).health_port == 9100
    argv = settings.to_args()
    assert "--health-port" not in argv and "x" * 32 not in argv  # the secret stays in the env
    assert "--redis" not in argv and not any("u:p@" in a for a in argv)  # so does the URL
    assert argv[argv.index("--import") + 1] == "a.b"


REDIS = {"ASYNCGRAPH_REDIS_URL": "redis://r"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "ASYNCGRAPH_REDIS_URL is required"),
        ({"ASYNCGRAPH_REDIS_URL": "http://r"}, "ASYNCGRAPH_REDIS_URL: invalid Redis URL"),
        ({**REDIS, "ASYNCGRAPH_CONCURRENCY": "many"}, "ASYNCGRAPH_CONCURRENCY must be an integer"),
        ({**REDIS, "ASYNCGRAPH_PROCESSES": "0"}, "ASYNCGRAPH_PROCESSES must be >= 1"),
        ({**REDIS, "ASYNCGRAPH_BACKEND": "curio"}, "ASYNCGRAPH_BACKEND"),
        ({**REDIS, "ASYNCGRAPH_QUEUE": "a b"}, "ASYNCGRAPH_QUEUE: queue name"),
        ({**REDIS, "ASYNCGRAPH_SECRET": "short"}, "ASYNCGRAPH_SECRET must be at least 16 bytes"),
        ({**REDIS, "ASYNCGRAPH_HEALTH_PORT": "http"}, "ASYNCGRAPH_HEALTH_PORT must be an integer"),
        ({**REDIS, "ASYNCGRAPH_HEALTH_PORT": "70000"}, "ASYNCGRAPH_HEALTH_PORT must be 0 to 65535"),
        ({**REDIS, "ASYNCGRAPH_LEASE_MS": "100"}, "ASYNCGRAPH_LEASE_MS must be >= 200"),
        ({**REDIS, "ASYNCGRAPH_DRAIN_TIMEOUT_S": "-1"}, "ASYNCGRAPH_DRAIN_TIMEOUT_S must be > 0"),
        ({**REDIS, "ASYNCGRAPH_CONNECT_TIMEOUT_S": "soon"}, "ASYNCGRAPH_CONNECT_TIMEOUT_S"),
        ({**REDIS, "ASYNCGRAPH_ALLOWED_BASE_URLS": "vllm:8000"}, "ASYNCGRAPH_ALLOWED_BASE_URLS"),
        ({**REDIS, "ASYNCGRAPH_LOG_LEVEL": "chatty"}, "ASYNCGRAPH_LOG_LEVEL"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load(env)


def test_metrics_print_exact_values_and_declare_the_task_seconds_summary() -> None:
    from asyncgraph.distributed.worker._metrics import Metrics, format_value

    metrics = Metrics()
    metrics.inc("asyncgraph_worker_tasks_total", 1234567, outcome="ok")
    metrics.observe("asyncgraph_worker_task_seconds", 0.1)
    metrics.observe("asyncgraph_worker_task_seconds", 0.2)
    metrics.set("asyncgraph_worker_tasks_in_flight", 3)
    text = metrics.render()
    assert 'asyncgraph_worker_tasks_total{outcome="ok"} 1234567\n' in text
    assert "# TYPE asyncgraph_worker_task_seconds summary\n" in text
    assert "asyncgraph_worker_task_seconds_sum 0.30000000000000004\n" in text  # repr: exact
    assert "asyncgraph_worker_task_seconds_count 2\n" in text
    assert "# TYPE asyncgraph_worker_task_seconds_sum" not in text
    assert "asyncgraph_worker_tasks_in_flight 3\n" in text
    assert [format_value(v) for v in (2**53 + 1, 1e300, float("nan"), float("-inf"))] == [
        "9007199254740993",
        "1e+300",
        "NaN",
        "-Inf",
    ]


@pytest.mark.slow
def test_python_m_workers_check_lists_the_default_functions() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCGRAPH_")}
    env["ASYNCGRAPH_REDIS_URL"] = "redis://127.0.0.1:1/0"
    result = subprocess.run(
        [sys.executable, "-m", "workers", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "workers.echo" in result.stdout
    for name, value, message in [
        ("ASYNCGRAPH_HEALTH_PORT", "abc", "ASYNCGRAPH_HEALTH_PORT must be an integer"),
        ("ASYNCGRAPH_IMPORTS", "workers.nope", "ASYNCGRAPH_IMPORTS: cannot import"),
        ("ASYNCGRAPH_SECRET", "too-short", "ASYNCGRAPH_SECRET must be at least 16 bytes"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "workers", "--check"],
            cwd=ROOT,
            env={**env, name: value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_fresh_workers_series_exist_at_zero_and_durations_are_histograms_per_function() -> None:
    from asyncgraph.distributed import Worker, WorkerConfig

    worker = Worker(WorkerConfig("redis://127.0.0.1:1/0"), {})
    text = worker.metrics.render()
    for series in (
        'asyncgraph_worker_tasks_total{outcome="ok"} 0',
        'asyncgraph_worker_tasks_total{outcome="client_gone"} 0',
        'asyncgraph_worker_dead_letters_total{reason="forged"} 0',
        'asyncgraph_worker_dead_letters_total{reason="oversize"} 0',
        "asyncgraph_worker_reclaimed_total 0",
        "asyncgraph_worker_abandoned_calls 0",
        'asyncgraph_worker_redis_refusals_total{code="OOM"} 0',
        'asyncgraph_worker_ignored_records_total{record="journal"} 0',
    ):
        assert series + "\n" in text, series
    for process in (
        "process_cpu_seconds_total ",
        "process_resident_memory_bytes ",
        "process_open_fds ",
    ):
        assert process in text
    metrics = worker.metrics
    for seconds in (0.003, 0.2, 7.0):
        metrics.observe_histogram(
            "asyncgraph_worker_task_duration_seconds", seconds, function="f", op="backward"
        )
    text = metrics.render()
    assert "# TYPE asyncgraph_worker_task_duration_seconds histogram\n" in text
    bucket = 'asyncgraph_worker_task_duration_seconds_bucket{function="f",le="%s",op="backward"}'
    for le, count in (("0.005", 1), ("0.25", 2), ("5.0", 2), ("10.0", 3), ("+Inf", 3)):
        assert f"{bucket % le} {count}\n" in text, le
    count = 'asyncgraph_worker_task_duration_seconds_count{function="f",op="backward"} 3\n'
    assert count in text


def test_histogram_buckets_are_cumulative_and_inclusive_and_snapshot_like_counters() -> None:
    from asyncgraph.distributed.worker._metrics import Metrics, merge_snapshots

    metrics = Metrics()
    for seconds in (0.005, 0.005, 0.0051, 400.0):  # on a bound counts in it (le: <=)
        metrics.observe_histogram("asyncgraph_worker_task_duration_seconds", seconds, op="b")
    get = metrics.get
    name = "asyncgraph_worker_task_duration_seconds"
    assert get(f"{name}_bucket", op="b", le="0.005") == 2
    assert get(f"{name}_bucket", op="b", le="0.025") == 3
    assert get(f"{name}_bucket", op="b", le="300.0") == 3
    assert get(f"{name}_bucket", op="b", le="+Inf") == 4
    assert get(f"{name}_count", op="b") == 4
    assert get(f"{name}_sum", op="b") == pytest.approx(400.0151)
    # A supervisor sums two children's snapshots series by series.
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for pid in ("1", "2"):
            path = Path(tmp) / f"{pid}.json"
            path.write_text(json.dumps({"metrics": metrics.snapshot()}))
            paths.append(path)
        total = merge_snapshots(paths, live={"1", "2"})
    assert total[(f"{name}_bucket", (("le", "+Inf"), ("op", "b")))] == 8
