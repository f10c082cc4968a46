"""The demo job on a priced simulated model: a cost cap has something to count."""

from asyncgraph.jobs import Job
from asyncgraph.jobs.demo import build_demo_job, demo_responder
from asyncgraph.models import Pricing, SimulatedModel
from asyncgraph.text import register_model

register_model(
    "priced-demo",
    SimulatedModel(
        latency_s=0.001, responder=demo_responder, tag_replies=False, pricing=Pricing(15.0, 60.0)
    ),
)


def build_job() -> Job:
    job, _ = build_demo_job("priced-demo", epochs=1)
    return job
