"""Every total a job reports adds up to its call log: the initial validation included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgraph.jobs import run_job
from asyncgraph.jobs.demo import build_demo_job, demo_responder
from asyncgraph.models import Pricing, SimulatedModel
from asyncgraph.text import register_model, unregister_model

pytestmark = pytest.mark.anyio


async def test_the_histories_totals_equal_the_sums_over_the_call_log(tmp_path: Path) -> None:
    priced = SimulatedModel(
        latency_s=0.0, responder=demo_responder, tag_replies=False, pricing=Pricing(0.15, 0.60)
    )
    register_model("priced-demo", priced)
    try:
        job, _ = build_demo_job("priced-demo", epochs=1)
        log = tmp_path / "calls.jsonl"
        result = await run_job(job, tmp_path / "run", progress=False, log_calls=log)
    finally:
        unregister_model("priced-demo")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(
        c["labels"].get("phase") == "validation" and c["labels"].get("step") == 0 for c in calls
    )
    last = result.history[-1]
    assert last["tokens"] == sum(c["prompt_tokens"] + c["completion_tokens"] for c in calls)
    assert last["cost_usd"] == pytest.approx(sum(c["cost_usd"] for c in calls))
    assert last["cost_usd"] > 0
    assert priced.usage.snapshot().total_tokens == last["tokens"]


async def test_every_file_of_a_run_is_the_users_alone(tmp_path: Path) -> None:
    job, _ = build_demo_job(epochs=1, latency_ms=0)
    out = tmp_path / "run"
    full = await run_job(job, out, progress=False, trace=True, log_calls=out / "calls.jsonl")
    # The initial validation's spend is kept for a resume to count from.
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["initial_usage"]["tokens"] > 0
    assert full.history[0]["tokens"] > checkpoint["initial_usage"]["tokens"]
    files = sorted(p for p in out.rglob("*") if p.is_file())
    names = {p.name for p in files}
    assert {"checkpoint.json", "best.json", "history.json", "steps.jsonl", "calls.jsonl"} <= names
    assert any(p.parent.name == "traces" for p in files)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: "0o600" for p in files
    }
