"""Optimizers that win: TGD against ParetoSearch at an equal budget of model calls, the
search's wall time against its critical path and against one call at a time, and
staged TGD updates against the critical path of a 3-stage pipeline.

The task is scripted (a ``SimulatedModel`` with a responder; not a language model):
every example needs one skill, and the solver answers it right when the system prompt
holds that skill's instruction and not the one that conflicts with it (two pairs
conflict: uppercase/lowercase, metric/imperial). The evaluator is code (the loss is its
explanation: which instruction to add or remove); the feedback model passes that on to
the prompt; the optimizer model applies the action named most often in its feedback;
a merge keeps the first version's instructions and adds the second's that do not
clash. TGD follows its batch's feedback wherever it leads (it oscillates between
conflicting instructions); the search keeps what validates best.

    python benchmarks/bench_optimizers.py [--latency-ms 50] [--budget 1000] [--fleet]
        [--gepa] [--rules-only]

Prints: final test accuracy of TGD (mean, min and max over 4 batch orders) and of the
search at the same call budgets (300, 600, 1000, 1500); at ``--budget`` the search's wall
time concurrently, its critical path (per round, the longest chain of
dependent model-call phases of a work item, times the latency, summed over rounds) and
one call at a time (measured, with a lock around every call); with ``--fleet`` the
search again with its backwards on 2 local worker processes through Redis; and the
staged-TGD pipeline's backward+step wall against its critical path. Exits 1 if a goal
is missed (search accuracy > TGD's mean from 600 calls up; search wall <= 1.2x its
critical path; staged backward+step <= 1.1x its critical path).

Then a second task whose rewrites add one rule at a time (8 hidden rules, no conflicts,
30 train / 20 val examples): per seed (3), TGD's and the search's calls-to-best (the
calls spent when the prompt each would return first reached its best validation score)
and their validation score at each budget from 200 to 2,000 calls; with ``--gepa`` also
DSPy's GEPA (``pip install dspy==3.4.1``, the ``bench-optim`` extra; 16 threads), its LM
an ``OpenAITestServer`` playing the same scripted model and counting the calls, and the
wall time of one run at 500 calls and ``--rule-latency-ms`` a call. Goals: the search's
validation >= TGD's at every budget, its calls-to-best <= GEPA's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from asyncgraph import Parameter, Variable
from asyncgraph.models import SimulatedModel
from asyncgraph.optim import TGD, ParetoSearch
from asyncgraph.text import DeterministicEvaluator, LLMCall, llm_call, register_model

HERE = os.path.dirname(os.path.abspath(__file__))
# Both tasks are the optimizer tests' (their folder has no package): one definition each.
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "optim"))

from rules_task import BASE as RULE_BASE  # noqa: E402
from rules_task import RuleProgram, RulesTask, tgd_curve  # noqa: E402
from skills_task import BASE, SkillProgram, SkillsTask, with_instructions  # noqa: E402

MODEL = "bench-skills"
LATENCY_ENV = "ASYNCGRAPH_BENCH_LATENCY_MS"
INSTRUCTIONS = {
    "names": "Spell names in full.",
    "units": "Show the unit.",
    "upper": "Answer in uppercase.",
    "lower": "Answer in lowercase.",
    "metric": "Use metric units.",
    "imperial": "Use imperial units.",
    "dates": "Write dates as YYYY-MM-DD.",
    "brief": "Answer in one word.",
}
CONFLICTS = {"upper": "lower", "lower": "upper", "metric": "imperial", "imperial": "metric"}
TRAIN_COUNTS = {"names": 4, "units": 4, "upper": 6, "lower": 4, "metric": 4, "imperial": 6,
                "dates": 4, "brief": 4}  # fmt: skip
EVAL_COUNTS = {"names": 2, "units": 2, "upper": 3, "lower": 2, "metric": 2, "imperial": 3,
               "dates": 2, "brief": 2}  # fmt: skip
SKILLS = SkillsTask(
    INSTRUCTIONS, CONFLICTS, {"train": TRAIN_COUNTS, "val": EVAL_COUNTS, "test": EVAL_COUNTS}
)
TRAIN, VAL, TEST = (SKILLS.splits[split] for split in ("train", "val", "test"))
_VARIABLE = re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL)


class Clock:
    """The scripted model's latency, and optionally one call at a time (a lock)."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.lock: anyio.Lock | None = None

    async def respond(self, messages: list[dict[str, Any]]) -> str:
        if self.lock is not None:
            async with self.lock:
                await anyio.sleep(self.latency_s)
        else:
            await anyio.sleep(self.latency_s)
        return SKILLS.respond(messages)


CLOCK = Clock(float(os.environ.get(LATENCY_ENV, "50")) / 1000)
register_model(MODEL, SimulatedModel(latency_s=0.0, responder=CLOCK.respond, tag_replies=False))


class SkillAnswer(LLMCall):
    """The solver call (a Function of this module, so workers can ``--import`` it)."""

    remote_name = "bench_optimizers:SkillAnswer"  # also when this file runs as __main__


def skills_program() -> SkillProgram:
    return SkillProgram(MODEL, task=SKILLS, call=SkillAnswer)


async def run_tgd(budget: int, batch_size: int = 8, seed: int = 0) -> tuple[str, int, float]:
    """TGD over shuffled batches until ``budget`` calls are spent: (prompt, calls, wall)."""
    started = time.perf_counter()
    curve = await tgd_curve(skills_program(), TRAIN, MODEL, seed, budget, batch_size)
    calls, prompt = curve[-1]
    return prompt, calls, time.perf_counter() - started


def critical_path_s(history: list[dict[str, Any]], latency_s: float) -> float:
    """Per round, the work item with the most dependent model-call phases; summed."""
    return latency_s * sum(max(len(w["stages"]) for w in row["work"]) for row in history)


async def run_search(
    budget: int, executor: Any = None, concurrency: int = 64, patience: int = 2
) -> tuple[Any, float]:
    search = ParetoSearch(
        skills_program(), TRAIN, VAL, model=MODEL, max_calls=budget, seed=0, proposals=4, merges=1,
        minibatch_size=4, max_concurrency=concurrency, executor=executor, patience=patience,
    )  # fmt: skip
    started = time.perf_counter()
    result = await search.run()
    return result, time.perf_counter() - started


# -- staged TGD ------------------------------------------------------------------------
STAGE_UPDATE_UNITS = {"stage 1 prompt": 1, "stage 2 prompt": 2, "stage 3 prompt": 3}


async def staged_pipeline(latency_s: float, staged: bool) -> float:
    """backward+step wall of a 3-stage text pipeline; stage k's feedback is final after
    (4 - k) feedback calls, and its update takes k calls' time (a longer prompt)."""

    async def respond(messages: list[dict[str, Any]]) -> str:
        text = "\n".join(str(m["content"]) for m in messages)
        if "IMPROVED_VARIABLE" in text:
            role = re.search(r"<ROLE>(.*?)</ROLE>", text)
            units = STAGE_UPDATE_UNITS.get(role.group(1).removeprefix("the ") if role else "", 1)
            await anyio.sleep(units * latency_s)
            value = _VARIABLE.findall(text)[-1]
            return f"<IMPROVED_VARIABLE>{value} (revised)</IMPROVED_VARIABLE>"
        await anyio.sleep(latency_s)
        return "Be more specific." if "feedback" in text.lower() else "an output"

    model = SimulatedModel(latency_s=0.0, responder=respond, tag_replies=False)
    prompts = [Parameter(f"Do stage {k}.", role=f"stage {k} prompt") for k in (1, 2, 3)]
    tgd = TGD(prompts, model=model, staged=staged)
    out: Variable = Variable("input", role="input")
    for p in prompts:
        out = await llm_call(p, out, model=model, role="stage output")

    def judge(text: str) -> tuple[float, str]:
        return 0.0, "The final output is vague."

    _, loss = await DeterministicEvaluator.apply(judge, out)
    started = time.perf_counter()
    await loss.backward()
    await tgd.step()
    wall = time.perf_counter() - started
    assert all(p.data.endswith("(revised)") for p in prompts)
    return wall


async def accuracy_table(budgets: Sequence[int], seeds: int) -> bool:
    """Test accuracy of TGD (several batch orders) and of the search at each budget."""
    CLOCK.latency_s = 0.0  # the results do not depend on the latency
    wins = True
    print(f"{'budget':>6}  {'TGD test acc (mean; min-max over ' + str(seeds) + ' seeds)':<44}"
          f"{'ParetoSearch test acc':<22}{'(patience=0)':<14}calls (TGD / search)")  # fmt: skip
    for budget in budgets:
        runs = [await run_tgd(budget, seed=seed) for seed in range(seeds)]
        accs = [SKILLS.accuracy(prompt, TEST) for prompt, _, _ in runs]
        result, _ = await run_search(budget)
        search_acc = SKILLS.accuracy(result.best.values["prompt"], TEST)
        wide, _ = await run_search(budget, patience=0)  # wide from the start
        wide_acc = SKILLS.accuracy(wide.best.values["prompt"], TEST)
        mean = sum(accs) / len(accs)
        print(f"{budget:>6}  {mean:.3f} ({min(accs):.3f}-{max(accs):.3f}){'':<27}"
              f"{search_acc:<22.3f}{wide_acc:<14.3f}{max(c for _, c, _ in runs)} / "
              f"{result.calls}")  # fmt: skip
        if budget >= 600:
            wins &= search_acc > mean
    return wins


# -- one rule at a time: ParetoSearch against TGD and GEPA -------------------------------
RULE_TASK = RulesTask(8, stride=5)  # example i follows rule 5i (mod 8)
RULES, RULE_TRAIN, RULE_VAL = RULE_TASK.rules, RULE_TASK.train, RULE_TASK.val
RULE_BUDGETS = (200, 300, 500, 1000, 2000)


def rule_reply_dspy(body: Mapping[str, Any]) -> str:
    """The same scripted model for DSPy's prompts: its ChatAdapter's solver calls and
    GEPA's instruction proposals."""
    messages = body["messages"]
    asked = str(messages[-1]["content"])
    if "[[ ## current_instruction ## ]]" in asked:  # GEPA's ProposeInstruction
        current = asked.split("[[ ## current_instruction ## ]]", 1)[1].split("[[ ##", 1)[0]
        new = RULE_TASK.add_most_named(current, asked.replace('\\"', '"'))  # the examples are JSON
        return json.dumps({"new_instruction": new})
    system = str(messages[0]["content"])
    instruction = system.split("your objective is:", 1)[-1]
    question = asked.split("[[ ## question ## ]]")[-1].strip().split("\n")[0].strip()
    answer = RULE_TASK.solve(instruction, question)
    return f"[[ ## answer ## ]]\n{answer}\n\n[[ ## completed ## ]]"


def rule_val(prompt: str) -> float:
    return RULE_TASK.accuracy(prompt, RULE_VAL)


async def rules_tgd(seed: int, limit: int, batch_size: int = 8) -> list[tuple[int, float]]:
    """Plain TGD on shuffled batches: (calls so far, validation score) after each step."""
    model = RULE_TASK.make_model()
    program = RuleProgram(model, RULE_TASK)
    curve = await tgd_curve(program, RULE_TRAIN, model, seed, limit, batch_size)
    return [(0, rule_val(RULE_BASE))] + [(calls, rule_val(prompt)) for calls, prompt in curve]


async def rules_search(
    seed: int, budget: int, latency_s: float = 0.0
) -> tuple[Any, list[tuple[int, float]]]:
    model = RULE_TASK.make_model(latency_s)
    search = ParetoSearch(
        RuleProgram(model, RULE_TASK), RULE_TRAIN, RULE_VAL, model=model, max_calls=budget,
        seed=seed, max_concurrency=16,
    )  # fmt: skip
    result = await search.run()
    curve = [(0, 0.0)] + [(row["calls"], row["best_score"]) for row in result.history]
    return result, curve


def rules_gepa(
    seed: int, budget: int, threads: int = 16, latency_s: float = 0.0
) -> list[tuple[int, float]] | None:
    """DSPy's GEPA on the same task, its LM an OpenAI-compatible test server playing the
    scripted model: (server calls when a candidate's validation ended, best validation
    so far).
    None if dspy is not installed (``pip install dspy==3.4.1``; not a dependency)."""
    try:
        import dspy  # type: ignore[import-not-found]
    except ImportError:
        return None
    from asyncgraph.models._testing import OpenAITestServer, Reply

    def answer(body: Any) -> Reply:
        return Reply(text=rule_reply_dspy(body), delay_s=latency_s)

    with OpenAITestServer(handler=answer) as server:
        lm = dspy.LM(
            "openai/bench-rules", api_base=server.url, api_key="test", cache=False,
            num_retries=0, temperature=0.0, max_tokens=512,
        )  # fmt: skip
        seen: list[int] = []

        def metric(gold: Any, pred: Any, trace: Any = None, pred_name: Any = None,
                   pred_trace: Any = None) -> Any:  # fmt: skip
            seen.append(len(server.requests))  # calls at the server when this was scored
            score, feedback = RULE_TASK.grade(str(getattr(pred, "answer", "")), gold.question)
            return dspy.Prediction(score=score, feedback=feedback or "Correct.")

        signature = dspy.Signature("question -> answer", RULE_BASE)
        student = dspy.Predict(signature)
        train = [dspy.Example(question=r["question"]).with_inputs("question") for r in RULE_TRAIN]
        val = [dspy.Example(question=r["question"]).with_inputs("question") for r in RULE_VAL]
        with dspy.context(lm=lm):
            optimizer = dspy.GEPA(
                metric=metric, reflection_lm=lm, max_metric_calls=budget, num_threads=threads,
                track_stats=True, seed=seed,
            )  # fmt: skip
            compiled = optimizer.compile(student, trainset=train, valset=val)
        details = compiled.detailed_results
        order = sorted(seen)
        curve: list[tuple[int, float]] = []
        best = 0.0
        for count, score in sorted(
            zip(details.discovery_eval_counts, details.val_aggregate_scores, strict=True)
        ):
            best = max(best, score)
            # Found after ``count`` metric calls, then validated on the whole val set.
            done = count + len(RULE_VAL)
            calls = order[min(done, len(order)) - 1]
            curve.append((calls, best))
        curve.append((len(server.requests), best))
        return curve


def at_budget(curve: Sequence[tuple[int, float]], budget: int) -> float:
    """The score of a curve of (calls, score) once ``budget`` calls are spent."""
    return max([s for c, s in curve if c <= budget] or [0.0])


def calls_to_best(curve: Sequence[tuple[int, float]]) -> tuple[int, float]:
    top = max(s for _, s in curve)
    return next(c for c, s in curve if s == top), top


async def rules_walls(latency_s: float, budget: int, gepa: bool) -> None:
    """Wall time of one run at ``budget`` calls with ``latency_s`` a call (seed 0)."""
    started = time.perf_counter()
    result, _ = await rules_search(0, budget, latency_s)
    line = (f"wall at {budget} calls, {latency_s * 1000:g} ms a call: ParetoSearch "
            f"{time.perf_counter() - started:.1f}s ({result.calls} calls)")  # fmt: skip
    if gepa:
        started = time.perf_counter()
        await anyio.to_thread.run_sync(rules_gepa, 0, budget, 16, latency_s)
        line += f", GEPA (16 threads) {time.perf_counter() - started:.1f}s"
    print(line)


async def rules_table(
    seeds: int, budgets: Sequence[int], gepa: bool, latency_s: float = 0.0, wall_budget: int = 500
) -> bool:
    """Calls-to-best and final validation at each budget of TGD, ParetoSearch and GEPA."""
    print(f"\none rule at a time: {len(RULES)} hidden rules, {len(RULE_TRAIN)} train / "
          f"{len(RULE_VAL)} val examples; every rewrite adds the rule its feedback names "
          f"most; calls counted at the model (GEPA: at the server)")  # fmt: skip
    limit = max(budgets)
    ok = True
    rows: dict[str, list[Any]] = {"TGD": [], "ParetoSearch": [], "GEPA": []}
    for seed in range(seeds):
        tgd = await rules_tgd(seed, limit)
        search_runs = {b: await rules_search(seed, b) for b in budgets}
        _, search_curve = search_runs[limit]
        finals = {
            "TGD": [at_budget(tgd, b) for b in budgets],
            "ParetoSearch": [search_runs[b][0].best_score for b in budgets],
        }
        ctb = {"TGD": calls_to_best(tgd), "ParetoSearch": calls_to_best(search_curve)}
        if gepa:
            started = time.perf_counter()
            curve = await anyio.to_thread.run_sync(rules_gepa, seed, limit)
            if curve is None:
                print("GEPA: dspy is not installed (pip install dspy==3.4.1); TGD only")
                gepa = False
            else:
                finals["GEPA"] = [at_budget(curve, b) for b in budgets]
                ctb["GEPA"] = calls_to_best(curve)
                print(f"  (GEPA seed {seed}: {time.perf_counter() - started:.0f}s, "
                      f"{curve[-1][0]} server calls)")  # fmt: skip
        for name, final in finals.items():
            rows[name].append((seed, ctb[name], final))
        ok &= all(s >= t for s, t in zip(finals["ParetoSearch"], finals["TGD"], strict=True))
        if "GEPA" in ctb:
            ok &= ctb["ParetoSearch"][0] <= ctb["GEPA"][0]
    header = "".join(f"{'val @' + str(b):>10}" for b in budgets)
    print(f"{'optimizer':<14}{'seed':>5}{'calls-to-best (score)':>24}{header}")
    for name, runs in rows.items():
        for seed, (calls, top), final in runs:
            cells = "".join(f"{v:>10.2f}" for v in final)
            print(f"{name:<14}{seed:>5}{calls:>16} ({top:.2f}){cells}")
    if latency_s > 0:
        await rules_walls(latency_s, wall_budget, gepa)
    print("goal: ParetoSearch's validation >= TGD's at every budget"
          + (" and its calls-to-best <= GEPA's" if gepa else "") + ": "
          + ("met" if ok else "MISSED"))  # fmt: skip
    return ok


async def main_async(args: argparse.Namespace) -> int:
    if args.rules_only:
        ok = await rules_table(
            args.rule_seeds, args.rule_budgets, args.gepa, args.rule_latency_ms / 1000
        )
        return 0 if ok else 1
    latency_s = args.latency_ms / 1000
    print(f"scripted skills task: {len(TRAIN)} train / {len(VAL)} val / {len(TEST)} test "
          f"examples, {len(INSTRUCTIONS)} instructions (2 conflicting pairs), simulated model")  # fmt: skip
    best = with_instructions([INSTRUCTIONS[k] for k in ("names", "units", "upper", "imperial",
                                                         "dates", "brief")])  # fmt: skip
    print(f"best possible test accuracy: {SKILLS.accuracy(best, TEST):.3f}; initial prompt: "
          f"{SKILLS.accuracy(BASE, TEST):.3f}\n")  # fmt: skip
    ok = await accuracy_table(args.budgets, args.seeds)
    print("goal: the search beats TGD's mean at budgets >= 600 calls:", "met" if ok else "MISSED")

    CLOCK.latency_s = latency_s
    result, wall = await run_search(args.budget)
    critical = critical_path_s(result.history, latency_s)
    print(f"\nsearch at {args.budget} calls, {args.latency_ms:g} ms per call, concurrency limit "
          f"64: wall {wall:.2f}s; critical path of its calls {critical:.2f}s ({result.rounds} "
          f"rounds): {wall / critical:.2f}x (goal <= 1.2x)")  # fmt: skip
    ok &= wall <= 1.2 * critical
    if args.sequential:
        CLOCK.lock = anyio.Lock()
        seq_result, seq_wall = await run_search(args.budget)
        CLOCK.lock = None
        same = seq_result.best.values == result.best.values and seq_result.calls == result.calls
        print(f"the same search one call at a time: {seq_wall:.1f}s ({seq_result.calls} calls, "
              f"same result: {same}): concurrent is {seq_wall / wall:.1f}x faster")  # fmt: skip
    if args.fleet:
        await fleet_run(args, result, wall)
    else:
        print("(--fleet: the search again with its backwards on 2 local Redis workers)")

    unit = latency_s * 5
    for staged in (False, True):
        w = min([await staged_pipeline(unit, staged) for _ in range(3)])
        critical = 4 * unit
        label = "TGD(staged=True)" if staged else "TGD (plain)     "
        print(f"3-stage pipeline, {label} backward+step {w:.3f}s, critical path "
              f"{critical:.3f}s: {w / critical:.2f}x" + (" (goal <= 1.1x)" if staged else ""))  # fmt: skip
        if staged:
            ok &= w <= 1.1 * critical
    ok &= await rules_table(
        args.rule_seeds, args.rule_budgets, args.gepa, args.rule_latency_ms / 1000
    )
    print("goals met" if ok else "GOAL MISSED")
    return 0 if ok else 1


async def fleet_run(args: argparse.Namespace, local: Any, local_wall: float) -> None:
    from asyncgraph.distributed import local_fleet, open_redis_executor

    os.environ[LATENCY_ENV] = str(args.latency_ms)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    with local_fleet(2, ["asyncgraph.text", "bench_optimizers"], queue="bench-opt") as url:
        async with open_redis_executor(url, queue="bench-opt", timeout_s=120.0) as executor:
            result, wall = await run_search(args.budget, executor=executor)
    same = result.best.values == local.best.values and result.calls == local.calls
    print(f"search with backwards on 2 Redis workers: wall {wall:.1f}s (in-process "
          f"{local_wall:.1f}s), same result: {same}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--budget", type=int, default=1000, help="calls, for the timings")
    parser.add_argument("--budgets", type=int, nargs="+", default=[300, 600, 1000, 1500])
    parser.add_argument("--seeds", type=int, default=4, help="TGD batch orders per budget")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--no-sequential", dest="sequential", action="store_false")
    parser.add_argument("--fleet", action="store_true", help="also on 2 local Redis workers")
    parser.add_argument("--rules-only", action="store_true", help="only the one-rule task")
    parser.add_argument("--rule-budgets", type=int, nargs="+", default=list(RULE_BUDGETS))
    parser.add_argument("--rule-seeds", type=int, default=3)
    parser.add_argument("--rule-latency-ms", type=float, default=100.0, help="for the walls")
    parser.add_argument("--gepa", action="store_true", help="also DSPy's GEPA (dspy==3.4.1)")
    args = parser.parse_args()
    return int(anyio.run(main_async, args, backend=args.backend))


if __name__ == "__main__":
    sys.exit(main())
