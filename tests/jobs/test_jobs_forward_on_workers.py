"""``Job(forward_on_workers=True)``: the forwards of remote Functions (training, validation)
run on the workers, with the history and parameters of the same job in-process; the
switch is ignored with a note in-process; ``asyncgraph run --workers N`` starts a local
fleet serving the job file's remote Functions.

Real processes: a redis-server and worker processes (``local_fleet``), and the CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import Parameter
from asyncgraph.jobs import Evaluation, Job, JobResult, run_job
from asyncgraph.jobs._ui import run_summary
from asyncgraph.optim import SGD

from .fleet_functions import ForwardPid, RemoteSquaredError, Weighted
from .jobs_helpers import (
    JOB_FILES,
    LR,
    MOMENTUM,
    TIMING_FIELDS,
    TRAIN,
    VAL,
    cli_env,
    describe,
    read_json,
    run_cli,
    without,
)

TESTS = Path(__file__).resolve().parents[1]
SECRET = secrets.token_hex(16)
QUEUE = f"fwd-{secrets.token_hex(4)}"


class RemoteLineFit:
    """The line-fit job of ``jobs_helpers`` with its loss and its metric as remote Functions;
    ``pids`` collects the process each metric's forward ran in."""

    def __init__(self, *, on_workers: bool) -> None:
        self.w = Parameter(0.0, role="slope")
        self.pids: set[int] = set()
        self.job = Job(
            name="remote-line-fit",
            parameters=[self.w],
            optimizer=SGD([self.w], lr=LR, momentum=MOMENTUM),
            forward=self.forward,
            train_set=list(TRAIN),
            val_set=VAL,
            batch_size=4,
            epochs=2,
            validate_every=2,
            max_concurrency=3,
            seed=3,
            forward_on_workers=on_workers,
        )

    async def forward(self, example: Mapping[str, Any]) -> Evaluation:
        loss = await RemoteSquaredError.apply(self.w, example["x"], example["y"])
        pid = await ForwardPid.apply(example["x"])
        self.pids.add(int(pid.data))
        score = float(loss.data < 0.0625)
        return Evaluation(loss=loss, score=score)


@pytest.fixture(scope="module")
def fleet_url(redis_server_url: str) -> Iterator[str]:
    """Two local workers serving ``fleet_functions`` (as ``jobs.fleet_functions``)."""
    from asyncgraph.distributed import local_fleet

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [before])])
    try:
        with local_fleet(
            2, [RemoteSquaredError.__module__], redis_url=redis_server_url, queue=QUEUE,
            secret=SECRET,
        ) as url:  # fmt: skip
            yield url
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _steps_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.anyio
async def test_forwards_on_two_workers_give_the_in_process_history_and_parameters(
    fleet_url: str, tmp_path: Path
) -> None:
    from asyncgraph.distributed import open_redis_executor

    here = RemoteLineFit(on_workers=False)
    expected = await run_job(here.job, tmp_path / "here")
    there = RemoteLineFit(on_workers=True)
    async with open_redis_executor(fleet_url, queue=QUEUE, secret=SECRET) as executor:
        got: JobResult = await run_job(there.job, tmp_path / "there", executor=executor)

    assert without(got.history, TIMING_FIELDS) == without(expected.history, TIMING_FIELDS)
    assert got.parameters == expected.parameters and got.parameters[0] != 0.0
    assert (got.initial_val_score, got.final_val_score) == (
        expected.initial_val_score,
        expected.final_val_score,
    )
    # Training and validation forwards ran on the workers, never here.
    assert here.pids == {os.getpid()}
    assert there.pids and os.getpid() not in there.pids
    assert (got.forward_on, expected.forward_on) == ("workers", "in-process")
    assert {line["forward_on"] for line in _steps_lines(tmp_path / "there")} == {"workers"}
    assert {line["forward_on"] for line in _steps_lines(tmp_path / "here")} == {"in-process"}
    # The dashboard's run list says it too.
    assert run_summary(tmp_path / "there")["forward_on"] == "workers"
    assert run_summary(tmp_path / "here")["forward_on"] == "in-process"


@pytest.mark.slow
@pytest.mark.anyio
async def test_inputs_passed_by_keyword_get_their_own_gradients_on_the_workers(
    fleet_url: str,
) -> None:
    from asyncgraph import backward, remote_forwards
    from asyncgraph.distributed import open_redis_executor

    async def grads(executor: Any) -> tuple[Any, ...]:
        a = Parameter(1.0, role="a")
        b = Parameter(10.0, role="b")
        with remote_forwards(executor):
            out = await Weighted.apply(scale=0.5, b=b, a=a)
        await backward(out, executor=executor)
        assert a.grad is not None and b.grad is not None
        return out.data, a.grad.data, b.grad.data

    async with open_redis_executor(fleet_url, queue=QUEUE, secret=SECRET) as executor:
        assert await grads(executor) == await grads(None) == (16.0, 1.0, 1.5)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_forward_input_that_cannot_travel_is_named(fleet_url: str) -> None:
    from asyncgraph import remote_forwards
    from asyncgraph.distributed import open_redis_executor

    async with open_redis_executor(fleet_url, queue=QUEUE, secret=SECRET) as executor:
        with remote_forwards(executor):
            with pytest.raises(
                TypeError, match=r"ForwardPid: args\[0\]: cannot serialize builtin_function"
            ):
                await ForwardPid.apply(len)


@pytest.mark.slow
@pytest.mark.anyio
async def test_without_the_switch_only_backwards_go_to_the_workers(
    fleet_url: str, tmp_path: Path
) -> None:
    from asyncgraph.distributed import open_redis_executor

    fit = RemoteLineFit(on_workers=False)
    async with open_redis_executor(fleet_url, queue=QUEUE, secret=SECRET) as executor:
        result = await run_job(fit.job, tmp_path / "out", executor=executor)
    assert fit.pids == {os.getpid()} and result.forward_on == "in-process"


@pytest.mark.anyio
async def test_the_switch_in_process_is_ignored_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    switched, plain = RemoteLineFit(on_workers=True), RemoteLineFit(on_workers=False)
    got = await run_job(switched.job, tmp_path / "a")
    expected = await run_job(plain.job, tmp_path / "b")
    err = capsys.readouterr().err
    assert "note: remote-line-fit: forward_on_workers is ignored" in err
    assert err.count("forward_on_workers") == 1  # the plain job says nothing
    assert got.forward_on == "in-process" and switched.pids == {os.getpid()}
    assert got.parameters == expected.parameters
    assert "forward_on_workers" not in switched.job.identity()  # a checkpoint resumes either way


def test_forward_on_workers_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"forward_on_workers must be True or False, got 'yes'"):
        Job(
            name="j",
            parameters=[Parameter(0.0)],
            optimizer=SGD([Parameter(0.0)], lr=0.1),
            forward=RemoteLineFit(on_workers=False).forward,
            train_set=TRAIN,
            forward_on_workers="yes",  # type: ignore[arg-type]
        )


def _fleet_env() -> dict[str, str]:
    before = os.environ.get("PYTHONPATH")
    return cli_env(
        PYTHONPATH=os.pathsep.join([str(TESTS / "jobs"), *filter(None, [before])]),
        ASYNCGRAPH_SECRET="",
    )


@pytest.mark.slow
def test_run_with_workers_runs_the_forwards_on_a_local_fleet(
    tmp_path: Path, redis_server_binary: None
) -> None:
    out, pids = tmp_path / "out", tmp_path / "pids.txt"
    env = {**_fleet_env(), "FLEET_JOB_PIDS": str(pids)}
    proc = run_cli(
        "run", str(JOB_FILES / "fleet_job.py"), "--workers", "2", "--queue", "fwd-cli",
        "--worker-concurrency", "1", "--no-progress", "--out", str(out), env=env,
        timeout_s=240,
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    assert "; forwards on the workers; " in proc.stdout, proc.stdout
    assert _steps_lines(out)[0]["forward_on"] == "workers"
    # Each line: the client's pid, then that of the process that ran the metric's forward.
    pairs = [line.split() for line in pids.read_text().splitlines()]
    assert len(pairs) == 8 + 3 * 2  # 8 training forwards; 2 validation ones, 3 times
    assert all(client != forward for client, forward in pairs)


def _eval_on(
    tmp_path: Path, name: str, *fleet: str, secret: str = ""
) -> tuple[str, list[list[str]]]:
    """``asyncgraph eval fleet_job.py`` of a slope of 2.0 on the 8 training examples, with
    the ``fleet`` flags: its output, and per forward the client's pid and the pid of the
    process that ran the metric's forward."""
    params, pids = tmp_path / "best.json", tmp_path / f"{name}.pids"
    best = {"format": "asyncgraph-best", "job": "fleet-job", "step": 1, "val_score": None}
    params.write_text(json.dumps({**best, "parameters": [{"role": "slope", "data": 2.0}]}))
    env = {**_fleet_env(), "FLEET_JOB_PIDS": str(pids), "ASYNCGRAPH_SECRET": secret}
    proc = run_cli(
        "eval", str(JOB_FILES / "fleet_job.py"), "--params", str(params), "--split", "train",
        *fleet, env=env, timeout_s=240,
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    return proc.stdout, [line.split() for line in pids.read_text().splitlines()]


@contextlib.contextmanager
def _job_file_fleet(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, prefix: str
) -> Iterator[tuple[str, str]]:
    """For ``--redis URL``: 2 workers of a fleet started here on ``redis_url``, serving
    fleet_job.py's Functions on a queue of their own; yields the URL and the queue."""
    from asyncgraph.distributed import local_fleet

    paths = [str(TESTS / "jobs"), str(JOB_FILES), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    queue = f"{prefix}-{secrets.token_hex(4)}"
    imports = ["fleet_functions", "fleet_job"]
    with local_fleet(2, imports, redis_url=redis_url, queue=queue, secret=SECRET) as url:
        yield url, queue


@pytest.mark.slow
def test_eval_with_workers_or_redis_runs_the_forwards_there_for_the_in_process_score(
    tmp_path: Path, redis_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2.0 * 0.2i against 0.5i: a squared error under 0.1 for i <= 3, 3 of the 8 examples.
    here, here_pids = _eval_on(tmp_path, "here")
    assert "forwards: in-process" in here and "score: 0.3750" in here, here
    assert len(here_pids) == 8 and all(client == forward for client, forward in here_pids)
    workers, worker_pids = _eval_on(
        tmp_path, "workers", "--workers", "2", "--worker-concurrency", "1", "--queue", "eval-w"
    )
    assert "forwards: on the workers" in workers and "score: 0.3750" in workers, workers
    assert len(worker_pids) == 8 and all(client != forward for client, forward in worker_pids)
    with _job_file_fleet(monkeypatch, redis_server_url, "eval") as (url, queue):
        there, there_pids = _eval_on(
            tmp_path, "redis", "--redis", url, "--queue", queue, secret=SECRET
        )
    assert "forwards: on the workers" in there and "score: 0.3750" in there, there
    (client,) = {c for c, _ in there_pids}
    assert len(there_pids) == 8 and client not in {f for _, f in there_pids}


def _run_fleet_job(tmp_path: Path, name: str, *fleet: str, secret: str = "") -> tuple[str, Path]:
    """``asyncgraph run fleet_job.py --out tmp_path/name`` with the ``fleet`` flags: its
    output (the run directory's path written OUT) and the run directory; each forward's
    client pid and metric-forward pid go to ``tmp_path/name.pids``."""
    out = tmp_path / name
    env = {
        **_fleet_env(),
        "FLEET_JOB_PIDS": str(tmp_path / f"{name}.pids"),
        "ASYNCGRAPH_SECRET": secret,
    }
    proc = run_cli(
        "run", str(JOB_FILES / "fleet_job.py"), "--no-progress", "--out", str(out), *fleet,
        env=env, timeout_s=240,
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    return proc.stdout.replace(str(out), "OUT"), out


@pytest.mark.slow
def test_run_on_the_workers_of_a_redis_runs_the_forwards_there_for_the_in_process_result(
    tmp_path: Path, redis_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    here, here_out = _run_fleet_job(tmp_path, "here")
    assert "forwards on the workers" not in here
    with _job_file_fleet(monkeypatch, redis_server_url, "run") as (url, queue):
        there, there_out = _run_fleet_job(
            tmp_path, "there", "--redis", url, "--queue", queue, secret=SECRET
        )
    assert "; forwards on the workers; " in there, there
    assert {line["forward_on"] for line in _steps_lines(there_out) if "forward_on" in line} == {
        "workers"
    }
    # Every forward (8 training ones; 2 validation ones, 3 times) ran on a worker.
    pids = [line.split() for line in (tmp_path / "there.pids").read_text().splitlines()]
    assert len(pids) == 8 + 3 * 2
    (client,) = {c for c, _ in pids}
    assert client not in {f for _, f in pids} and str(os.getpid()) not in {f for _, f in pids}
    # The in-process run's result: the same final and best parameters and scores, printed
    # and written.
    assert there[there.index("final parameters:") :] == here[here.index("final parameters:") :]
    assert "slope: " in here and "best validation score" in here
    assert read_json(there_out / "best.json") == read_json(here_out / "best.json")
    want, got = read_json(here_out / "checkpoint.json"), read_json(there_out / "checkpoint.json")
    for key in ("step", "initial_val_score", "parameters", "optimizer", "best", "spent"):
        assert got[key] == want[key], key
    assert without(got["history"], TIMING_FIELDS) == without(want["history"], TIMING_FIELDS)


def test_eval_on_workers_of_a_job_that_keeps_its_forwards_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncgraph.cli import main

    job_file = str(JOB_FILES / "best_job.py")  # no forward_on_workers: nothing to send
    assert main(["eval", job_file, "--workers", "2"]) == 2  # before any process starts
    err = capsys.readouterr().err
    assert "job 'best-job' runs its forwards in this process" in err
    assert "set forward_on_workers=True in build_job()" in err
    assert main(["eval", job_file, "--worker-concurrency", "1"]) == 2
    assert "--worker-concurrency sizes the workers of --workers N" in capsys.readouterr().err


def test_run_with_workers_refuses_a_job_file_s_remote_function_without_remote_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncgraph.cli import build_parser
    from asyncgraph.jobs._run_cli import run

    args = build_parser("run").parse_args(
        ["run", str(JOB_FILES / "fleet_job_own_function.py"), "--workers", "2",
         "--no-progress", "--out", str(tmp_path / "out")]
    )  # fmt: skip
    assert run(args) == 2  # before any process starts
    err = capsys.readouterr().err
    assert "the job file defines the remote Function Inline without a remote_name" in err
    assert "remote_name = 'fleet_job_own_function.Inline'" in err
    assert not (tmp_path / "out").exists()


def test_run_takes_either_redis_or_workers(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncgraph.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser("run").parse_args(
            ["run", "job.py", "--workers", "2", "--redis", "redis://127.0.0.1:1/0"]
        )
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_worker_concurrency_without_workers_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncgraph.cli import build_parser
    from asyncgraph.jobs._run_cli import run

    args = build_parser("run").parse_args(
        ["run", str(JOB_FILES / "fleet_job_own_function.py"), "--worker-concurrency", "1",
         "--no-progress", "--out", str(tmp_path / "out")]
    )  # fmt: skip
    assert run(args) == 2
    assert "--worker-concurrency sizes the workers of --workers N" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_with_workers_names_a_too_short_secret_before_the_job_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgraph.cli import build_parser
    from asyncgraph.jobs._run_cli import run

    monkeypatch.setenv("ASYNCGRAPH_SECRET", "too-short")
    monkeypatch.syspath_prepend(str(TESTS / "jobs"))
    args = build_parser("run").parse_args(
        ["run", str(JOB_FILES / "fleet_job.py"), "--workers", "2", "--no-progress",
         "--out", str(tmp_path / "out")]
    )  # fmt: skip
    assert run(args) != 0  # local_fleet refuses it before any process starts
    assert "ASYNCGRAPH_SECRET" in capsys.readouterr().err
    assert not (tmp_path / "out" / "checkpoint.json").exists()
