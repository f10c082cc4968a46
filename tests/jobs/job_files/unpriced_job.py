"""The demo job on a simulated model without a price: ``asyncgraph run unpriced_job.py
--max-cost 1`` refuses it before any call. Each call of the model appends a line to the
file named by ``$UNPRICED_JOB_CALLS``."""

import os

from asyncgraph.jobs import Job
from asyncgraph.jobs.demo import build_demo_job, demo_responder
from asyncgraph.models import SimulatedModel
from asyncgraph.text import register_model


def answer(messages):
    with open(os.environ["UNPRICED_JOB_CALLS"], "a") as calls:
        calls.write("call\n")
    return demo_responder(messages)


model = SimulatedModel(latency_s=0.001, responder=answer, tag_replies=False)
model.pricing = None
register_model("unpriced-demo", model)


def build_job() -> Job:
    job, _ = build_demo_job("unpriced-demo", epochs=1)
    return job
