"""The job spec: what a batch job is (``Job``), what its forward returns for one example
(``Evaluation``) and how a run of it ended (``JobResult``).

A ``Job`` checks its settings when it is made, and knows what follows from them: its
steps, the mini-batch of each step, and its identity (what a checkpoint must match to
be resumed by it). Running it is ``_runner``'s; its checkpoint is ``_checkpoint``'s.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from asyncgraph import Module, Parameter, Variable
from asyncgraph._redact import redact_data

from ._checkpoint import fingerprint_data

__all__ = ["Evaluation", "Job", "JobResult"]


@dataclass
class Evaluation:
    """What a job's forward returns for one example.

    ``loss`` is where backward starts (text feedback from a judge, or a number);
    ``score`` is the metric in [0, 1] (e.g. exact match), never differentiated.

    Example::

        async def forward(example):
            answer = await program(Variable(example["question"], role="question"))
            loss = await TextLoss("Is the answer right?", model="simulated")(answer)
            return Evaluation(loss=loss, score=float(answer.data == example["answer"]))
    """

    loss: Variable
    score: float
    prediction: Any = None


class _Optimizer(Protocol):
    def zero_grad(self) -> None: ...

    def step(self) -> Awaitable[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class Job:
    """A prompt (or program) optimization job.

    ``forward(example)`` builds the graph for one example and returns an
    :class:`Evaluation`. ``parameters`` are what ``optimizer`` updates; their
    values are checkpointed. ``parameters`` may be a :class:`asyncgraph.Module`
    (the program whose ``forward`` the job's ``forward`` calls): its parameters,
    in ``named_parameters()`` order, are the job's, the checkpoint stores its
    ``state_dict()`` (field ``"module"``, with the parameters' names and roles
    in ``"parameters"``), and a resume loads it back with ``load_state_dict``
    (so a checkpoint from a Module with other parameters is refused by name). Tokens and cost are those of every model call
    made by the job (``asyncgraph.models.track_usage``), on workers too when
    the backward runs on a fleet. ``config`` holds the settings that
    change the job's results and are not visible to the runner (model, endpoint,
    optimizer options, ...): a JSON-able map, part of the job's identity, so a
    checkpoint is only resumed by a job configured the same way. It is redacted wherever
    it goes (the checkpoint, MLflow's params, the dashboard): a URL's password and
    credential query values, the value of a key that names a credential (``api_key``,
    ``token``, ``headers: {Authorization: ...}``), and the secrets asyncgraph knows, so
    it may hold a ``base_url`` with credentials; two configs that differ only there are
    the same job.

    Keeping the best: with a ``val_set``, the parameters with the best validation score
    so far (the initial ones included) are written to ``best.json`` in the run
    directory whenever they improve. ``keep_best=True`` also reverts a step that
    lowered the validation score: the parameters go back to the best ones (the
    optimizer's state is kept). ``patience=N`` stops the job early after N validations
    in a row without a better score. ``test_set``: held-out examples the job never
    trains or selects on; ``asyncgraph eval`` scores saved parameters on it.

    The forward on the fleet: ``forward_on_workers=True``, in a job run with an executor
    that can run forwards (``run_job(..., executor=redis_executor)``, ``asyncgraph run
    --redis URL`` or ``--workers N``), runs the forward of every ``dispatch = "remote"``
    Function that the job's ``forward`` applies (in training and validation; ``evaluate``
    called on its own does so inside ``remote_forwards(executor)``) on the workers too, not only its backward (see :func:`asyncgraph.remote_forwards`):
    for a metric that runs generated code, a model hosted on each worker, a function
    that needs the worker's files or GPU. Such a Function's forward must be ``async
    def``. Results and gradients are those of the same job in-process. In a run without
    such an executor the switch is ignored, with a note on stderr;
    ``JobResult.forward_on`` says where the forwards ran. Not part of the job's identity:
    a checkpoint resumes either way.

    A cost cap: ``max_cost_usd`` stops the job before a step that is expected to pass
    it (estimated from the dearest step so far), and cuts a step that passes it anyway,
    keeping the checkpoint of the last whole step; ``JobResult.stopped_at_cost_cap``
    says so, and a resume with a higher cap continues. The cap is not part of the job's
    identity, and it needs every model priced: before its first call, a capped job
    raises ``ModelConfigError`` for a model without a ``Pricing`` that it can be seen to
    reach (the optimizer's; the Module's, all the way down; those ``forward`` refers to:
    its object, its nonlocal and global variables, one level into the objects and
    functions there, its ``model=`` arguments; the default models). A model that cannot be
    seen so (built or named while the job runs) is caught at its first call: that call
    stops the job with the same error.

    Replies that cannot be parsed do not end the job: an example whose forward raises
    ``StructuredOutputError`` (a judge's verdict, or any reply, that never fit its
    ``response_format`` after its attempts) counts as not passed (score 0, no loss, so
    no feedback), in training and in validation, and each step's history row lists it
    under ``skipped_examples``; an update the optimizer could not read (``TGD``'s
    skipped updates) leaves its parameter as it was and is listed under
    ``skipped_updates``. The progress line and the dashboard show both, and
    ``JobResult.skipped_updates`` / ``skipped_examples`` count them. ``strict=True``
    ends the job at the first such reply instead (and makes a ``TGD`` optimizer strict).
    Not part of the job's identity.

    Raises ``ValueError`` for an empty ``train_set``, a size or ``patience`` that is not
    a positive int (a bool is not one), a ``config`` that is not JSON, a
    ``forward_on_workers`` that is not a bool, or ``keep_best`` / ``patience`` without a
    ``val_set``.

    Example::

        prompt = Parameter("Answer with a number.", role="system prompt")

        async def forward(example):
            answer = await llm_call(prompt, example["question"], model="simulated")
            loss = await TextLoss("Is the answer right?", model="simulated")(answer)
            return Evaluation(loss=loss, score=float(example["answer"] in answer.data))

        job = Job(name="arith", parameters=[prompt], optimizer=TGD([prompt], model="simulated"),
                  forward=forward, train_set=train, val_set=val, batch_size=4)
    """

    name: str
    parameters: Sequence[Parameter] | Module
    optimizer: _Optimizer
    forward: Callable[[Mapping[str, Any]], Awaitable[Evaluation]]
    train_set: Sequence[Mapping[str, Any]]
    val_set: Sequence[Mapping[str, Any]] = ()
    batch_size: int = 8
    epochs: int = 1
    max_concurrency: int = 16
    validate_every: int = 1
    seed: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)
    test_set: Sequence[Mapping[str, Any]] = ()
    keep_best: bool = False
    patience: int | None = None
    max_cost_usd: float | None = None
    forward_on_workers: bool = False
    strict: bool = False
    module: Module | None = field(init=False, default=None, repr=False)
    """The Module given as ``parameters``, else None."""
    params: list[Parameter] = field(init=False, default_factory=list, repr=False)
    """The parameters as a list (those of the Module, when one was given)."""
    param_names: list[str] = field(init=False, default_factory=list, repr=False)
    """Their dotted names in the Module (empty without one)."""

    def __post_init__(self) -> None:
        if isinstance(self.parameters, Module):
            self.module = self.parameters
            named = list(self.module.named_parameters())
            if not named:
                raise ValueError(
                    f"job {self.name!r}: its Module {type(self.module).__name__} has no "
                    f"parameters to optimize"
                )
            self.param_names = [name for name, _ in named]
            self.params = [param for _, param in named]
        else:
            self.params = list(self.parameters)
        if not self.train_set:
            raise ValueError(f"job {self.name!r} has an empty train_set")
        for name in ("batch_size", "epochs", "max_concurrency", "validate_every"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(
                    f"job {self.name!r}: {name} must be a positive int, got {getattr(self, name)!r}"
                )
        self._config_json()
        if self.patience is not None and not _is_positive_int(self.patience):
            raise ValueError(
                f"job {self.name!r}: patience must be a positive int or None, got {self.patience!r}"
            )
        cap = self.max_cost_usd
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf
        ):
            raise ValueError(
                f"job {self.name!r}: max_cost_usd must be a positive number of US dollars or "
                f"None, got {cap!r}"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(
                f"job {self.name!r}: strict must be True or False, got {self.strict!r}"
            )
        if not isinstance(self.forward_on_workers, bool):
            raise ValueError(
                f"job {self.name!r}: forward_on_workers must be True or False, got "
                f"{self.forward_on_workers!r}"
            )
        if (self.keep_best or self.patience is not None) and not self.val_set:
            raise ValueError(
                f"job {self.name!r}: keep_best and patience need a val_set to measure progress on"
            )

    def _config_json(self) -> dict[str, Any]:
        """``config`` as it reads back from a checkpoint (tuples become lists, ...)."""
        if not isinstance(self.config, Mapping):
            raise ValueError(f"job {self.name!r}: config must be a map, got {self.config!r:.80}")
        try:
            text = json.dumps(dict(self.config), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"job {self.name!r}: config must be JSON (str keys; str, numbers, bool, None, "
                f"lists and maps; no NaN), got {self.config!r:.120} ({exc})"
            ) from None
        loaded: dict[str, Any] = json.loads(text)
        return loaded

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_set) / self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this job (JSON data)."""
        identity = {
            "name": self.name,
            "parameters": [p.role for p in self.params],
            "train_set": fingerprint_data(list(self.train_set)),
            "val_set": fingerprint_data(list(self.val_set)),
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.seed,
            "optimizer": type(self.optimizer).__name__,
            # Redacted (a base URL's password, an api_key...): the identity is written to
            # the checkpoint, and a resume with a rotated key is the same job.
            "config": redact_data(self._config_json(), by_name=True),
        }
        if self.module is not None:
            identity["module"] = list(self.param_names)
        # Only when set: checkpoints of jobs without them keep resuming.
        if self.keep_best:
            identity["keep_best"] = True
        if self.patience is not None:
            identity["patience"] = self.patience
        return identity

    def batch(self, step: int) -> list[Mapping[str, Any]]:
        """The mini-batch of ``step`` (0-based): a seeded permutation per epoch, cut in order."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.train_set)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        chosen = order[index * self.batch_size : (index + 1) * self.batch_size]
        return [self.train_set[i] for i in chosen]


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class JobResult:
    """How a job ended: its metrics history and final parameter values.

    ``plot_path`` is where ``metrics.png`` was written, None when it was not
    (matplotlib is not installed, or drawing failed). ``already_finished`` is True
    when a resume found every step done: nothing ran and nothing was rewritten.

    Example::

        result = await run_job(job, "runs/arith")     # a JobResult
        print(result.steps_done, result.initial_val_score, result.final_val_score)
        print(result.best_path)                       # runs/arith/best.json
    """

    history: list[dict[str, Any]]
    parameters: list[Any]
    initial_val_score: float | None
    final_val_score: float | None
    steps_done: int
    interrupted: bool
    out_dir: Path
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    plot_path: Path | None = None
    already_finished: bool = False
    best_val_score: float | None = None
    """The best validation score seen (the initial one included); None without a val_set."""
    best_step: int | None = None
    """The step after which the parameters of ``best.json`` were found (0: the initial ones)."""
    best_path: Path | None = None
    """``best.json`` in the run directory, None when none was written."""
    best_parameters: list[Any] | None = None
    """The values of the best parameters, in the job's parameter order."""
    stopped_at_cost_cap: bool = False
    """True when ``Job.max_cost_usd`` stopped the job (resume with a higher cap to go on)."""
    cost_usd: float = 0.0
    """What every priced model call of the job cost, in US dollars (all runs of it, the
    calls of a step cut by Ctrl-C, an error or the cap and rolled back included: they were
    paid); an upper bound when ``cut_calls`` (``cost_is_upper_bound``)."""
    replayed_calls: int = 0
    """Model calls that a rerun remote task replayed from its journal instead of paying
    for them again (all runs of the job)."""
    cut_calls: int = 0
    """Model calls cut before their answer came back (Ctrl-C, an error, a call past its
    timeout; all runs of the job): each is in ``cost_usd`` at an upper bound of what it
    could have been billed (its prompt, and its ``max_tokens`` of answer)."""
    max_cost_usd: float | None = None
    """The cap this run had."""
    stopped_early: bool = False
    """True when ``patience`` ended the job before its last step."""
    skipped_updates: int = 0
    """Updates the optimizer skipped because it could not read the model's reply (all
    steps of this run; each step's are in its history row)."""
    skipped_examples: int = 0
    """Examples scored 0 because a reply never fit its ``response_format`` (training and
    validation, this run)."""
    forward_on: str = "in-process"
    """Where the forwards of remote Functions ran: ``"workers"`` (``Job.forward_on_workers``
    with an executor that runs them) or ``"in-process"``."""

    @property
    def cost_is_upper_bound(self) -> bool:
        """True when ``cost_usd`` is an upper bound: calls were cut before their answer."""
        return self.cut_calls > 0
