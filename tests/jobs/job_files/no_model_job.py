"""A job whose forward forgets its model: every example of a step fails at once."""

from asyncgraph import Module, Parameter, Variable
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.optim import TGD
from asyncgraph.text import deterministic_evaluator, llm_call

DATA = [{"n": n, "label": "even" if n % 2 == 0 else "odd"} for n in range(1, 9)]


def metric(answer: str, label: str) -> tuple[float, str]:
    return (1.0, "") if answer == label else (0.0, f"expected {label!r}")


class Classifier(Module):
    def __init__(self) -> None:
        super().__init__()
        self.prompt = Parameter("Label the number.", role="system prompt")

    async def forward(self, example: dict[str, object]) -> Evaluation:
        question = Variable(f"Number: {example['n']}", role="question")
        answer = await llm_call(self.prompt, question)  # no model: a TypeError per example
        score, loss = await deterministic_evaluator(metric, answer, example["label"])
        return Evaluation(loss=loss, score=score.data)


def build_job() -> Job:
    program = Classifier()
    return Job(
        name="no-model",
        parameters=program,
        forward=program,
        optimizer=TGD(program.parameters(), model="simulated"),
        train_set=DATA[:4],
        val_set=DATA[4:],
        batch_size=4,
        epochs=1,
    )
