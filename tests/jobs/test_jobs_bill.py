"""One bill (issue #33, invariant 9): what a job reports it spent is what the provider
billed, within 1%, or above it and labelled an upper bound where answers were lost.

The provider is a local OpenAI-compatible server that bills every answer it computes,
whether or not its client is still there to read it (``OpenAITestServer.bill``), priced
from the project's table (``PRICES["gpt-4o-mini"]``, OpenAI's published prices). The
server holds some requests until the test lets them go, so that a cap or an error falls
while calls are in flight: in process (a cap mid-wave, a step that fails with a model
error), and on a fleet (real redis-server and worker processes; a cap cancels remote
tasks whose calls are in flight, and the workers report what those calls spent).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import Parameter
from asyncgraph.jobs import Evaluation, Job, JobResult, run_job
from asyncgraph.jobs import _spending as spending
from asyncgraph.jobs._cli_common import cost_line, spending_line
from asyncgraph.jobs._ui import run_summary
from asyncgraph.models import ModelRequestError, OpenAIChat, observe_calls
from asyncgraph.models._prices import PRICES
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.optim import SGD, TGD
from asyncgraph.text import llm_call

from .jobs_helpers import LR, TRAIN, read_json
from .spending_functions import ASK_MAX_TOKENS, ASK_PRICE, WAIT, PricedAsk
from .test_jobs_fleet_spending import MODULE, fleet, run_on

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PRICE = PRICES["gpt-4o-mini"]
MAX_TOKENS = 40  # each call's answer, at most: the answer's share of a cut call's bound
HOLD_S = 30.0  # a held request is answered after this long if the test never lets it go
QUESTIONS = [f"question {i}: what is {i} plus {i}?" for i in range(4)]


class HoldingServer(OpenAITestServer):
    """Bills what it answers (as every ``OpenAITestServer``); ``hold(body)`` says whether a
    request waits for ``release()`` before it is answered, ``answer(body)`` may script
    another reply (an error). ``held`` counts the requests waiting or answered after one."""

    def __init__(
        self,
        hold: Callable[[Any], bool],
        answer: Callable[[Any], Reply | None] = lambda body: None,
    ) -> None:
        self.released = threading.Event()
        self.held = 0
        self._hold, self._reply = hold, answer
        super().__init__(handler=self._answer_or_hold)

    def _answer_or_hold(self, body: Any) -> Reply | None:
        if self._hold(body):
            with self._cond:
                self.held += 1
                self._cond.notify_all()
            self.released.wait(HOLD_S)
        return self._reply(body)

    def wait_held(self, count: int) -> None:
        """Block (in a server thread) until ``count`` requests were held, ``HOLD_S`` at most."""
        with self._cond:
            self._cond.wait_for(lambda: self.held >= count, HOLD_S)

    def release(self) -> None:
        self.released.set()


def asked(body: Any) -> str:
    """The last message of a request (the question, in a forward's call)."""
    return str(body["messages"][-1]["content"])


def asking_job(url: str, cap: float | None, name: str = "asking") -> Job:
    """One step of four forwards at once, each asking the server (gpt-4o-mini's prices),
    whose backwards ask it for feedback; the optimizer is the free simulated model."""
    prompt = Parameter("Answer in one short sentence.", role="system prompt")
    model = OpenAIChat("gpt-4o-mini", base_url=url, api_key="sk-test", pricing=PRICE)

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        answer = await llm_call(
            prompt, example["q"], model=model, params={"max_tokens": MAX_TOKENS}
        )
        return Evaluation(loss=answer, score=0.0)

    return Job(
        name=name,
        parameters=[prompt],
        optimizer=TGD([prompt], model="simulated"),
        forward=forward,
        train_set=[{"q": q} for q in QUESTIONS],
        batch_size=len(QUESTIONS),
        max_concurrency=len(QUESTIONS),
        max_cost_usd=cap,
    )


def assert_one_bill(reported: float, cut_calls: int, billed: float) -> None:
    """Invariant 9: within 1% of the bill, or above it and labelled an upper bound."""
    assert billed > 0
    if cut_calls:  # answers were lost: an upper bound, and said to be one
        assert reported >= billed
    else:
        assert reported == pytest.approx(billed, rel=0.01)


@pytest.fixture
def first_answered() -> Iterator[threading.Event]:
    """Set as the job's first model call has been counted (an observer runs after it)."""
    event = threading.Event()
    with observe_calls(lambda call: event.set()):
        yield event


async def test_a_cap_passed_mid_wave_lets_the_calls_in_flight_finish_and_counts_them(
    tmp_path: Path, first_answered: threading.Event
) -> None:
    # The first forward's answer passes the cap while the three others are at the server,
    # held there until that answer was counted: they are not cancelled, and are counted.
    first = QUESTIONS[0]

    def hold(body: Any) -> bool:  # the first is answered once the three others are held
        if first in asked(body):
            server.wait_held(3)
            return False
        return True

    server = HoldingServer(hold=hold)
    with server:
        first_answered_then_release = threading.Thread(
            target=lambda: first_answered.wait(HOLD_S) and server.release(), daemon=True
        )
        first_answered_then_release.start()
        out = tmp_path / "capped"
        result = await run_job(asking_job(server.url, cap=1e-7), out, progress=False)
        assert server.wait_for_bill(4)
        billed = server.billed_usd(PRICE)
        assert result.stopped_at_cost_cap and result.steps_done == 0
        assert len(server.requests) == 4 and server.held == 3  # nothing sent past the cap
        assert result.cut_calls == 0 and not result.cost_is_upper_bound
        assert_one_bill(result.cost_usd, result.cut_calls, billed)
        spent = read_json(out / "checkpoint.json")["spent"]
        assert spent["cost_usd"] == pytest.approx(result.cost_usd) and spent["cut_calls"] == 0
        assert run_summary(out)["cost_usd"] == pytest.approx(result.cost_usd)

        # The resumed run's total is the whole bill: the cut step's calls, and the rest.
        resumed = await run_job(asking_job(server.url, cap=1.0), out, resume=True, progress=False)
        assert resumed.steps_done == 1 and not resumed.stopped_at_cost_cap
        assert server.wait_for_bill(len(server.requests))
        assert_one_bill(resumed.cost_usd, resumed.cut_calls, server.billed_usd(PRICE))
        assert resumed.cost_usd == pytest.approx(server.billed_usd(PRICE), rel=0.01)


async def test_a_call_still_out_when_the_cap_stops_waiting_is_cut_and_counted_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, but the three calls in flight are held past the cap's wait (DRAIN_S, made
    # short): the job stops without them, counts them at their upper bound, and says so.
    monkeypatch.setattr(spending, "DRAIN_S", 0.3)
    first = QUESTIONS[0]

    def hold(body: Any) -> bool:
        if first in asked(body):
            server.wait_held(3)
            return False
        return True

    server = HoldingServer(hold=hold)
    with server:
        try:
            result = await run_job(
                asking_job(server.url, cap=1e-7), tmp_path / "out", progress=False
            )
        finally:
            server.release()
        assert server.wait_for_bill(4)
        billed = server.billed_usd(PRICE)
    assert result.stopped_at_cost_cap and result.steps_done == 0
    assert result.cut_calls == 3 and result.cost_is_upper_bound
    assert_one_bill(result.cost_usd, result.cut_calls, billed)
    line = spending_line(result)
    assert line is not None and line.startswith("spent at most $")


def failing(body: Any) -> Reply | None:
    """A 400 for the last question's forward (not billed: refused), the others answered."""
    return Reply(status=400, error="refused") if QUESTIONS[-1] in asked(body) else None


async def test_a_step_that_fails_keeps_its_paid_calls_in_what_the_job_spent(
    tmp_path: Path, first_answered: threading.Event
) -> None:
    # The refused call is answered once the three others were counted: nothing is cut.
    counted = threading.Event()
    calls: list[Any] = []

    def count(call: Any) -> None:
        calls.append(call)
        if len(calls) >= 3:
            counted.set()

    last = QUESTIONS[-1]
    server = HoldingServer(hold=lambda body: last in asked(body), answer=failing)
    threading.Thread(target=lambda: counted.wait(HOLD_S) and server.release(), daemon=True).start()
    out = tmp_path / "failed"
    with server, observe_calls(count):
        with pytest.raises(BaseException) as raised:  # the step's error (in its group)
            await run_job(asking_job(server.url, cap=0.9), out, progress=False)
        assert server.wait_for_bill(3)
        billed = server.billed_usd(PRICE)
    assert isinstance(leaf(raised.value), ModelRequestError)
    spent = read_json(out / "checkpoint.json")["spent"]
    assert spent["cut_calls"] == 0
    assert_one_bill(spent["cost_usd"], spent["cut_calls"], billed)
    assert run_summary(out)["cost_usd"] == pytest.approx(spent["cost_usd"])


async def test_a_step_that_fails_with_calls_in_flight_counts_them_at_an_upper_bound(
    tmp_path: Path,
) -> None:
    # The refused call is answered at once; the three others are at the server, held
    # until the job has failed: cut, counted at their upper bound, and labelled so.
    last = QUESTIONS[-1]
    server = HoldingServer(hold=lambda body: last not in asked(body), answer=failing)
    out = tmp_path / "failed"
    with server:
        with pytest.raises(BaseException) as raised:
            await run_job(asking_job(server.url, cap=0.9), out, progress=False)
        server.release()
        assert server.wait_for_bill(3)  # the provider finished them: billed all the same
        billed = server.billed_usd(PRICE)
    assert isinstance(leaf(raised.value), ModelRequestError)
    spent = read_json(out / "checkpoint.json")["spent"]
    assert spent["cut_calls"] == 3
    assert_one_bill(spent["cost_usd"], spent["cut_calls"], billed)
    summary = run_summary(out)
    assert summary["cut_calls"] == 3 and summary["cost_usd"] == pytest.approx(spent["cost_usd"])


# -- on a fleet ------------------------------------------------------------------------------


def priced_line_fit(base_url: str, cap: float) -> Job:
    """One step of the line fit over four examples: four remote backwards at once, each
    asking the server once (``PricedAsk``, gpt-4o-mini's prices) on a worker."""
    w = Parameter(0.0, role="slope")

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        return Evaluation(loss=PricedAsk.apply(w, example["x"], example["y"], base_url), score=0.0)

    return Job(
        name="priced-line-fit",
        parameters=[w],
        optimizer=SGD([w], lr=LR),
        forward=forward,
        train_set=list(TRAIN[:4]),
        batch_size=4,
        max_concurrency=4,
        max_cost_usd=cap,
    )


ONE_CALL = ASK_PRICE.cost_usd(5, 1)  # a five-word question, a one-word answer


async def test_on_a_fleet_a_cancelled_task_reports_the_calls_it_made_and_they_are_counted(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The first backward to ask is told to wait (its call answered and paid); the three
    # others reply, the third passes the cap, and the waiting task is cancelled on its
    # worker: its reply to the cancel reports its call, and the job counts it.
    answers = iter([WAIT])
    server = HoldingServer(
        hold=lambda body: False, answer=lambda body: Reply(text=next(answers, "fine"))
    )
    with server, fleet(redis_url, monkeypatch, [MODULE], allowed_base_urls=[server.url]) as queue:
        job = priced_line_fit(server.url, cap=2.5 * ONE_CALL)
        result = await run_on(redis_url, queue, job, tmp_path / "capped")
        assert server.wait_for_bill(4)
        billed = server.billed_usd(ASK_PRICE)
    assert result.stopped_at_cost_cap and result.steps_done == 0
    assert billed == pytest.approx(4 * ONE_CALL)
    assert result.cut_calls == 0 and not result.cost_is_upper_bound
    assert_one_bill(result.cost_usd, result.cut_calls, billed)
    assert read_json(tmp_path / "capped" / "checkpoint.json")["spent"]["cost_usd"] == pytest.approx(
        result.cost_usd
    )


async def test_on_a_fleet_calls_cut_by_a_cancel_are_reported_at_an_upper_bound(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The first question is answered once all four are at the server, and passes the cap;
    # the three others are held there until the job ended: their tasks are cancelled, the
    # calls cut on the workers, which report them at their upper bound; the server bills them.
    questions: list[str] = []
    arrived = threading.Condition()

    def hold(body: Any) -> bool:
        with arrived:
            questions.append(asked(body))
            arrived.notify_all()
            first = len(questions) == 1
            if first:
                arrived.wait_for(lambda: len(questions) == 4, HOLD_S)
        return not first

    server = HoldingServer(hold=hold, answer=lambda body: Reply(text="fine"))
    with server, fleet(redis_url, monkeypatch, [MODULE], allowed_base_urls=[server.url]) as queue:
        job = priced_line_fit(server.url, cap=0.5 * ONE_CALL)
        try:
            result = await run_on(redis_url, queue, job, tmp_path / "cut")
        finally:
            server.release()
        assert server.wait_for_bill(4)  # the provider finished them: billed all the same
        billed = server.billed_usd(ASK_PRICE)
        counter = OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="sk-test")
    assert result.stopped_at_cost_cap and result.steps_done == 0
    assert result.cut_calls == 3 and result.cost_is_upper_bound
    assert_one_bill(result.cost_usd, result.cut_calls, billed)
    # Each cut call at its bound: at most the request's bytes in, max_tokens out.
    least = [
        ASK_PRICE.cost_usd(
            counter.estimate_prompt_tokens([{"role": "user", "content": q}]), ASK_MAX_TOKENS
        )
        for q in questions[1:]
    ]
    assert result.cost_usd >= ONE_CALL + sum(least)
    assert run_summary(tmp_path / "cut")["cut_calls"] == 3


def leaf(error: BaseException) -> BaseException:
    """The first error inside (nested) exception groups."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def test_the_summary_lines_say_when_the_cost_is_an_upper_bound(tmp_path: Path) -> None:
    row = {"step": 1, "cost_usd": 0.25, "cut_calls": 2}
    result = JobResult(
        [row],
        [],
        None,
        None,
        0,
        False,
        tmp_path,
        stopped_at_cost_cap=True,
        cost_usd=0.25,
        cut_calls=2,
        max_cost_usd=0.2,
    )
    assert result.cost_is_upper_bound
    line = spending_line(result)
    assert line is not None and "spent at most $0.2500 of the $0.2 cap" in line
    assert "an upper bound: 2 model call(s) were cut before their answer came back" in line
    stop = cost_line(result)
    assert stop is not None and stop.startswith("stopped at the cost cap: at most $0.2500")
    exact = JobResult([row], [], None, None, 1, False, tmp_path, cost_usd=0.25)
    assert spending_line(exact) == "spent $0.2500 on model calls"
