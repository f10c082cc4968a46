"""What a job spends on a fleet (issue #27): the cost cap counts the workers' calls, and
a worker SIGKILLed after its model call returned bills that call once (the rerun replays
it); the job's result, checkpoint and dashboard say so, and its parameters are exact.

Real processes: the suite's redis-server and worker processes (``local_fleet``); the
models are a priced simulated one registered on both sides (``spending_functions``) and
a local OpenAI-compatible HTTP server.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import secrets
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from asyncgraph import Parameter
from asyncgraph.distributed import local_fleet, open_redis_executor
from asyncgraph.jobs import Evaluation, Job, JobResult, run_job
from asyncgraph.jobs._demo_cli import WORKER_IMPORTS
from asyncgraph.jobs._ui import run_summary
from asyncgraph.jobs.demo import build_demo_job
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.optim import SGD

from .jobs_helpers import (
    LR,
    MOMENTUM,
    TIMING_FIELDS,
    TRAIN,
    VAL,
    read_json,
    reference_fit,
    run_events,
    without,
)
from .spending_functions import CALLS_ENV, PRICED_MODEL, AskedSquaredError, read_calls

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TESTS = Path(__file__).resolve().parents[1]
SECRET = secrets.token_hex(16)
MODULE = AskedSquaredError.__module__  # "jobs.spending_functions", as the workers import it
# A killed worker's task is taken over after three seconds, not the default lease (10 s).
# Not shorter: a worker's first model call imports httpx and builds its SSL context, about
# 0.2 s of CPU that holds its loop, and on a loaded machine (CI) a 1 s lease lapsed there:
# the other worker reclaimed the task and asked the question again in the clean run.
FAST_RERUN = ("--lease-ms", "3000", "--drain-timeout-s", "1")


@contextlib.contextmanager
def fleet(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, imports: Sequence[str], **options: Any
) -> Iterator[str]:
    """Two workers on a queue of their own on the suite's Redis, serving ``imports`` (with
    ``tests/`` on their ``PYTHONPATH``); yields the queue."""
    before = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), *filter(None, [before])]))
    queue = f"spend-{secrets.token_hex(4)}"
    with local_fleet(2, imports, redis_url=redis_url, queue=queue, secret=SECRET, **options):
        yield queue


async def run_on(url: str, queue: str, job: Job, out: Path, **options: Any) -> JobResult:
    async with open_redis_executor(url, queue=queue, secret=SECRET, timeout_s=60) as executor:
        return await run_job(job, out, executor=executor, progress=False, **options)


def values_after(out: Path, step: int) -> list[Any]:
    """The parameters' values after ``step``, from ``out/steps.jsonl``."""
    for line in (out / "steps.jsonl").read_text("utf-8").splitlines():
        row = json.loads(line)
        if row.get("step") == step and "parameters" in row:
            return [p["value"] for p in row["parameters"]]
    raise AssertionError(f"no parameters for step {step} in {out}/steps.jsonl")


def paid(rows: Sequence[tuple[int, float]]) -> float:
    return math.fsum(cost for _, cost in rows)


# -- 1. the cost cap on a fleet ------------------------------------------------------------


async def test_a_capped_job_on_a_fleet_counts_the_workers_calls_and_resumes_to_the_uncapped_end(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = tmp_path / "calls.txt"  # every priced call, made here or on a worker
    monkeypatch.setenv(CALLS_ENV, str(calls))  # before the workers start: they read it too
    here = os.getpid()
    with fleet(redis_url, monkeypatch, [*WORKER_IMPORTS, MODULE]) as queue:
        job, _ = build_demo_job(PRICED_MODEL, epochs=1)
        uncapped = await run_on(redis_url, queue, job, tmp_path / "uncapped")
        rows = read_calls(calls)
        # The backwards' feedback calls were made (and paid) on the workers, and counted.
        assert any(pid != here for pid, _ in rows) and any(pid == here for pid, _ in rows)
        assert uncapped.cost_usd == pytest.approx(paid(rows), rel=1e-9)
        costs = [row["cost_usd"] for row in uncapped.history]
        assert len(costs) == 3 and uncapped.steps_done == 3

        # Step 3 would pass the cap: the job stops at the boundary before it.
        cap = (costs[1] + costs[2]) / 2
        job, prompt = build_demo_job(PRICED_MODEL, epochs=1)
        job.max_cost_usd = cap
        out, start = tmp_path / "capped", len(rows)
        capped = await run_on(redis_url, queue, job, out)
        rows = read_calls(calls)[start:]
        assert capped.stopped_at_cost_cap and not capped.interrupted
        assert capped.steps_done == 2 and capped.cost_usd <= cap
        # What it spent is every priced call of the run, the workers' included.
        assert capped.cost_usd == pytest.approx(paid(rows), rel=1e-9)
        assert paid([r for r in rows if r[0] != here]) > 0
        assert capped.cost_usd == pytest.approx(costs[1], rel=1e-9)
        # The checkpoint of the last whole step: the uncapped run's after step 2.
        ckpt = read_json(out / "checkpoint.json")
        assert ckpt["step"] == 2 and ckpt["spent"]["cost_usd"] == pytest.approx(capped.cost_usd)
        assert capped.parameters == [prompt.data] == values_after(tmp_path / "uncapped", 2)
        assert without(ckpt["history"], TIMING_FIELDS | {"cost_usd"}) == without(
            uncapped.history[:2], TIMING_FIELDS | {"cost_usd"}
        )
        assert run_events(out)[-1] == ("stop", 2, "cost_cap")
        assert run_summary(out)["stopped_at_cost_cap"] and run_summary(out)["max_cost_usd"] == cap

        # A resume with a higher cap ends where the uncapped run on the fleet ended.
        job, prompt = build_demo_job(PRICED_MODEL, epochs=1)
        job.max_cost_usd = costs[-1] * 2
        resumed = await run_on(redis_url, queue, job, out, resume=True)
        rows = read_calls(calls)[start:]
    assert not resumed.stopped_at_cost_cap and resumed.steps_done == 3
    assert resumed.parameters == uncapped.parameters == [prompt.data]
    assert resumed.final_val_score == uncapped.final_val_score
    assert resumed.cost_usd == pytest.approx(costs[-1], rel=1e-9)
    assert resumed.cost_usd == pytest.approx(paid(rows), rel=1e-9)


# -- 4. a worker SIGKILLed after its model call returned -----------------------------------


class ScaleServer(OpenAITestServer):
    """Answers ``"scale N"``, N the number of times that question was asked so far: a
    question asked again gets another answer, and so another gradient."""

    def __init__(self) -> None:
        self.asked: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        super().__init__(handler=self._scale)

    def _scale(self, body: Any) -> Reply:
        question = str(body["messages"][-1]["content"])
        with self._lock:
            self.asked[question] += 1
            return Reply(text=f"scale {self.asked[question]}")


def asked_line_fit(base_url: str, hold: tuple[str, str]) -> Job:
    """The line fit of ``jobs_helpers`` (3 steps of 4 examples) with ``AskedSquaredError``
    as its loss: each backward node asks the server once, on a worker."""
    w = Parameter(0.0, role="slope")

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        loss = AskedSquaredError.apply(w, example["x"], example["y"], base_url, hold)
        score = float(abs(w.data * example["x"] - example["y"]) < 0.25)
        return Evaluation(loss=loss, score=score)

    return Job(
        name="asked-line-fit",
        parameters=[w],
        optimizer=SGD([w], lr=LR, momentum=MOMENTUM),
        forward=forward,
        train_set=list(TRAIN),
        val_set=VAL,
        batch_size=4,
        epochs=1,
        max_concurrency=3,
        seed=3,
    )


async def poll(check: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    with anyio.fail_after(timeout_s):
        # Polled: what it waits for is set by a worker, in another process.
        while not (value := check()):  # noqa: ASYNC110
            await anyio.sleep(0.02)
    return value


async def test_a_worker_killed_after_its_model_call_returned_bills_it_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tag = f"spend-kill-{secrets.token_hex(4)}"
    hold = (redis_url, tag)
    client = redis.Redis.from_url(redis_url)
    with (
        ScaleServer() as server,
        # One task at a time per worker: the killed one has only the held task in flight.
        fleet(
            redis_url,
            monkeypatch,
            [MODULE],
            concurrency=1,
            extra_args=FAST_RERUN,
            allowed_base_urls=[server.url],
        ) as queue,  # fmt: skip
        contextlib.closing(client),
    ):
        base_url = server.url
        clean = await run_on(redis_url, queue, asked_line_fit(base_url, hold), tmp_path / "clean")
        clean_asked = dict(server.asked)
        assert len(clean_asked) == 12 and set(clean_asked.values()) == {1}
        server.asked.clear()

        client.set(f"{tag}:hold", 1)  # the first backward to ask holds before its reply
        out, results = tmp_path / "killed", []
        async with anyio.create_task_group() as tg:

            async def job() -> None:
                job = asked_line_fit(base_url, hold)
                results.append(await run_on(redis_url, queue, job, out))

            tg.start_soon(job)
            pid = int(await poll(lambda: client.lindex(f"{tag}:called", 0)))
            assert pid != os.getpid() and sum(server.asked.values()) >= 1  # asked: paid
            os.kill(pid, signal.SIGKILL)  # ... and its reply is never written
            client.delete(f"{tag}:hold")
        (result,) = results

    # The rerun replayed the call: every question was asked once, as in the clean run
    # (asked again, it would have answered "scale 2" and doubled a gradient).
    assert dict(server.asked) == clean_asked
    assert result.replayed_calls == 1 and clean.replayed_calls == 0
    ckpt = read_json(out / "checkpoint.json")
    assert ckpt["spent"]["replayed_calls"] == 1 and ckpt["history"][-1]["replayed_calls"] == 1
    assert run_summary(out)["replayed_calls"] == 1
    assert run_summary(tmp_path / "clean")["replayed_calls"] == 0
    # Billed once: the same spend as the clean run.
    assert result.cost_usd == pytest.approx(clean.cost_usd, rel=1e-9) and result.cost_usd > 0
    # Exact gradients: the parameters after every step are the clean run's, and the
    # hand-written fit's at the end.
    for step in range(1, 4):
        assert values_after(out, step) == values_after(tmp_path / "clean", step)
    assert result.parameters == clean.parameters
    assert result.parameters[0] == reference_fit(asked_line_fit(base_url, hold))[0]
    assert without(result.history, TIMING_FIELDS | {"replayed_calls", "cost_usd"}) == without(
        clean.history, TIMING_FIELDS | {"replayed_calls", "cost_usd"}
    )
