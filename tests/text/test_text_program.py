"""The proof of ``Module``: a three-stage program (planner, solver, critic) optimized by
TGD over a scripted dataset, saved, and loaded into a fresh process, which gives the
same answers."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import anyio
import pytest
from program_helpers import (
    CHECK_RULE,
    DATASET,
    MODEL,
    PLAN_RULE,
    SOLVE_RULE,
    ThreeStage,
    answers,
    exact,
)

from asyncgraph import Variable, backward
from asyncgraph.optim import TGD, NoFeedbackWarning
from asyncgraph.text import deterministic_evaluator

pytestmark = pytest.mark.anyio

HERE = Path(__file__).resolve().parent


async def train(program: ThreeStage, epochs: int) -> list[tuple[float, int]]:
    """TGD over DATASET in batches of 2; (batch accuracy, NoFeedbackWarnings) per step."""
    tgd = TGD(program.parameters(), model=MODEL)
    steps = []
    for _ in range(epochs):
        for start in range(0, len(DATASET), 2):
            batch = DATASET[start : start + 2]

            async def closure(batch: list[dict[str, str]] = batch) -> float:
                tgd.zero_grad()
                scores: list[float] = []
                losses: list[Variable] = []
                for row in batch:
                    final = await program(row["question"])
                    score, loss = await deterministic_evaluator(exact, final, row["answer"])
                    scores.append(score.data)
                    losses.append(loss)
                await backward(losses)
                return sum(scores) / len(scores)

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", NoFeedbackWarning)
                accuracy = await tgd.step(closure)
            assert all(w.category is NoFeedbackWarning for w in caught)
            steps.append((accuracy, len(caught)))
    return steps


@pytest.mark.slow
async def test_a_three_stage_program_trains_saves_and_reloads_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    program = ThreeStage()
    names = [name for name, _ in program.named_parameters()]
    assert names == ["planner.prompt", "solver.prompt", "critic.prompt"]
    untrained = await answers(program)
    assert all(a != row["answer"] for a, row in zip(untrained, DATASET, strict=True))

    steps = await train(program, epochs=2)
    # Step 1 teaches the critic and the solver, step 2 the planner; then every answer is
    # right, the evaluator explains nothing, and each prompt draws a NoFeedbackWarning.
    assert steps == [(0.0, 0), (0.0, 0), (1.0, 3), (1.0, 3)]
    state = program.state_dict()
    assert state == {
        "planner.prompt": f"You plan how to answer the question. {PLAN_RULE}",
        "solver.prompt": f"You solve the question. {SOLVE_RULE}",
        "critic.prompt": f"You check the draft answer. {CHECK_RULE}",
    }
    trained = await answers(program)
    assert trained == [row["answer"] for row in DATASET]

    saved = tmp_path / "three_stage.json"
    program.save(saved)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    with anyio.fail_after(120):
        done = await anyio.run_process(
            [sys.executable, "-m", "program_helpers", str(saved)], env=env, check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    fresh = json.loads(done.stdout)
    assert fresh == {"answers": trained, "state": state}
