"""Every exception asyncgraph raises: one tree, rooted at ``AsyncGraphError``.

Hierarchy (``tests/test_exceptions.py`` checks it against the classes, and the copy in
``docs/reference/errors.md``)::

    AsyncGraphError                                       every asyncgraph error
    ├── GraphError (also RuntimeError)                    misuse of a graph or a GradManager
    ├── BackwardError (also RuntimeError)                 a node's backward (or hook) failed
    │   ├── RemoteError                                   ... on a worker: its traceback text
    │   ├── RemoteConnectionError (also ConnectionError)  Redis lost while a node was remote
    │   └── RemoteTimeoutError (also TimeoutError)        no worker answered in time
    ├── WireError (also ValueError)                       a message failed validation
    ├── RedisConnectionLost (also ConnectionError)        Redis unreachable, gone or silent
    ├── ReplyError                                        an error reply of the Redis server
    ├── ModelError                                        a model call failed
    │   ├── ModelStatusError                              the server answered an HTTP error
    │   │   ├── ModelRequestError                         other 4xx: never retried
    │   │   ├── ModelRequestTimeoutError                  408: retried
    │   │   ├── ModelRateLimitedError                     429: retried after Retry-After
    │   │   └── ModelServerError                          5xx: retried
    │   ├── ModelConnectionError                          no connection, or lost: retried
    │   ├── ModelTimeoutError                             an attempt passed timeout_s: retried
    │   ├── ModelResponseError                            not a readable chat completion
    │   ├── ModelRetryError                               every attempt failed
    │   ├── RateLimitWaitError                            the wait would pass max_wait_s
    │   ├── ModelBackendError                             a limiter's or cache's store failed
    │   └── ModelConfigError (also ValueError)            a model setting is invalid
    ├── UnknownModelError (also LookupError)              a model spec names no model
    ├── StructuredOutputError (also ValueError)           a reply never fit response_format
    ├── OptimizerError                                    an optimizer step failed
    │   └── UpdateParseError (also ValueError)            no improved value in the reply
    ├── ConfigError (also ValueError)                     a worker setting is invalid
    ├── FleetError (also RuntimeError)                    a local fleet could not start
    ├── CheckpointError                                   a job checkpoint cannot be used
    └── JobFileError                                      a job file cannot be run

    UserWarning
    └── NoFeedbackWarning                                 a parameter got no gradient

Each class is defined here and exported by the package that raises it, which is where
users import it from: ``asyncgraph`` (graph, backward, remote and wire errors),
``asyncgraph.resp``, ``asyncgraph.models``, ``asyncgraph.text``, ``asyncgraph.optim``,
``asyncgraph.distributed`` and ``asyncgraph.jobs``. This module imports nothing of
asyncgraph, so every package may import it, the standalone model clients and the RESP
client included. An error keeps a builtin second base where Python or PyTorch code
already catches that one (``RuntimeError`` for misuse of the graph, ``ValueError`` for a
bad value, ``ConnectionError``, ``TimeoutError``).

Wrong arguments to the Python API (a type, a value out of range) raise the builtin
``TypeError`` / ``ValueError``. Cancellation is never wrapped: it propagates untouched.
"""

from __future__ import annotations

__all__ = [
    "AsyncGraphError",
    "BackwardError",
    "CheckpointError",
    "ConfigError",
    "FleetError",
    "GraphError",
    "JobFileError",
    "ModelBackendError",
    "ModelConfigError",
    "ModelConnectionError",
    "ModelError",
    "ModelRateLimitedError",
    "ModelRequestError",
    "ModelRequestTimeoutError",
    "ModelResponseError",
    "ModelRetryError",
    "ModelServerError",
    "ModelStatusError",
    "ModelTimeoutError",
    "NoFeedbackWarning",
    "OptimizerError",
    "RateLimitWaitError",
    "RedisConnectionLost",
    "RemoteConnectionError",
    "RemoteError",
    "RemoteTimeoutError",
    "ReplyError",
    "StructuredOutputError",
    "UnknownModelError",
    "UpdateParseError",
    "WireError",
]


class AsyncGraphError(Exception):
    """Base class of every asyncgraph error."""


# -- the core (exported by ``asyncgraph``) ------------------------------------------------


class GraphError(AsyncGraphError, RuntimeError):
    """The graph cannot be used as asked: a freed graph, inputs that do not require grad,
    a hook on a variable without grad, a ``GradManager`` not recording.

    A ``RuntimeError`` too, as PyTorch raises for the same misuse.
    """


class BackwardError(AsyncGraphError, RuntimeError):
    """A node's backward failed; ``__cause__`` is the original exception.

    ``function`` is the Function's name, ``input_roles`` / ``output_roles`` the
    roles of the variables it connects.
    """

    def __init__(
        self,
        message: str,
        *,
        function: str = "",
        input_roles: tuple[str, ...] = (),
        output_roles: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.function = function
        self.input_roles = input_roles
        self.output_roles = output_roles


class RemoteError(BackwardError):
    """A backward that ran on a worker failed; ``remote_traceback`` is its text."""

    def __init__(self, message: str, *, remote_traceback: str = "", **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.remote_traceback = remote_traceback


class RemoteConnectionError(BackwardError, ConnectionError):
    """Redis could not be reached or went away while a node's backward was remote."""


class RemoteTimeoutError(BackwardError, TimeoutError):
    """No worker answered for a remote node within the executor's timeout."""


class WireError(AsyncGraphError, ValueError):
    """A message crossing a process boundary is malformed, too large or forged."""


# -- the RESP client (exported by ``asyncgraph.resp``) ------------------------------------


class RedisConnectionLost(AsyncGraphError, ConnectionError):
    """Redis could not be reached, went away mid-call, or did not answer in time."""


class ReplyError(AsyncGraphError):
    """An error reply of the Redis server (``-ERR ...``, ``-NOGROUP ...``)."""

    @property
    def code(self) -> str:
        """The reply's first word: ``ERR``, ``NOGROUP``, ``MOVED`` ..."""
        return str(self).split(" ", 1)[0]


# -- the model clients (exported by ``asyncgraph.models``) --------------------------------


class ModelError(AsyncGraphError):
    """A model call failed. ``model`` names the model, ``retryable`` says if retrying may help.

    ``retryable`` is what the retry middleware goes by.
    """

    retryable: bool = False

    def __init__(self, message: str, *, model: str = "") -> None:
        super().__init__(message)
        self.model = model


class ModelStatusError(ModelError):
    """The server answered with HTTP ``status_code``; ``server_message`` is its error text."""

    def __init__(
        self,
        message: str,
        *,
        model: str = "",
        status_code: int,
        server_message: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, model=model)
        self.status_code = status_code
        self.server_message = server_message
        self.retry_after_s = retry_after_s


class ModelRequestError(ModelStatusError):
    """A 4xx answer other than 408 and 429 (bad request, bad key, unknown model): not retried.

    409 Conflict is in this group too: on a generic server resending the same request does
    not resolve a conflict.
    """

    retryable = False


class ModelRequestTimeoutError(ModelStatusError):
    """A 408 answer: the server stopped waiting for the request (e.g. a slow upload); retried."""

    retryable = True


class ModelRateLimitedError(ModelStatusError):
    """A 429 answer; ``retry_after_s`` is the server's Retry-After, if it sent one."""

    retryable = True


class ModelServerError(ModelStatusError):
    """A 5xx answer: the server failed, retrying may help."""

    retryable = True


class ModelConnectionError(ModelError):
    """The connection could not be opened or was lost before an answer arrived."""

    retryable = True


class ModelTimeoutError(ModelError):
    """One attempt did not finish within its deadline (``timeout_s``)."""

    retryable = True


class ModelResponseError(ModelError):
    """The answer is not a readable chat completion: a 2xx with another body, or a body
    that cannot be decoded (bad compression, too many redirects)."""

    retryable = False


class ModelRetryError(ModelError):
    """Every one of ``attempts`` attempts failed; ``__cause__`` / ``last_error`` is the last one."""

    retryable = False

    def __init__(self, message: str, *, model: str = "", attempts: int, last_error: ModelError):
        super().__init__(message, model=model)
        self.attempts = attempts
        self.last_error = last_error


class RateLimitWaitError(ModelError):
    """The rate limiter would make this call wait ``wait_s`` > ``max_wait_s``; nothing was reserved."""

    retryable = False

    def __init__(self, message: str, *, model: str = "", wait_s: float, max_wait_s: float):
        super().__init__(message, model=model)
        self.wait_s = wait_s
        self.max_wait_s = max_wait_s


class ModelBackendError(ModelError):
    """A shared backend (Redis for a rate limit or cache, a cache directory) failed or timed out."""

    retryable = False


class ModelConfigError(ModelError, ValueError):
    """A model setting is invalid or missing: an environment variable
    (``ASYNCGRAPH_MODEL_*``, ``OPENAI_API_KEY``, ``OPENAI_BASE_URL``) or an option given to
    a model (``base_url``), found where the model is built, before any call.

    ``variable`` names the setting, ``value`` is what it held.
    """

    retryable = False

    def __init__(self, message: str, *, variable: str, value: str) -> None:
        super().__init__(message)
        self.variable = variable
        self.value = value


# -- textual Functions (exported by ``asyncgraph.text``) ----------------------------------


class UnknownModelError(AsyncGraphError, LookupError):
    """``resolve_model(spec)`` found no registered model and could not build one.

    ``spec`` is the name asked for, ``base_url`` the server it was asked with.
    """

    def __init__(self, message: str, *, spec: str, base_url: str | None = None) -> None:
        super().__init__(message)
        self.spec = spec
        self.base_url = base_url


class StructuredOutputError(AsyncGraphError, ValueError):
    """A reply never followed its ``response_format`` schema.

    ``path`` is where the last reply failed (``$`` the whole reply, ``$.steps[2]`` ...),
    ``reply`` its text, ``attempts`` how many replies were tried.
    """

    def __init__(self, message: str, *, path: str, reply: str, attempts: int) -> None:
        super().__init__(message)
        self.path = path
        self.reply = reply
        self.attempts = attempts


# -- optimizers (exported by ``asyncgraph.optim``) ----------------------------------------


class OptimizerError(AsyncGraphError):
    """An optimizer step failed; no parameter was changed by that step."""


class UpdateParseError(OptimizerError, ValueError):
    """Every attempt's reply lacked the tags around the improved value.

    ``role`` is the parameter's role, ``attempts`` how many replies were tried,
    ``reply`` the last reply (in full; the message shows an excerpt).
    """

    def __init__(self, message: str, *, role: str, attempts: int, reply: str) -> None:
        super().__init__(message)
        self.role = role
        self.attempts = attempts
        self.reply = reply


# -- the worker fleet (exported by ``asyncgraph.distributed``) ----------------------------


class ConfigError(AsyncGraphError, ValueError):
    """A worker setting that is wrong: ``field`` names it, ``problem`` says what is wrong.

    ``str()`` names the field as a Python keyword; ``WorkerConfig.from_env`` and
    ``from_args`` re-word it with the variable or the flag the user wrote.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(self.worded(field))

    def with_name(self, name: str) -> ConfigError:
        """The same error, naming the setting as ``name`` (a variable or a flag)."""
        named = ConfigError(self.field, self.problem)
        named.args = (self.worded(name),)
        return named

    def worded(self, name: str) -> str:
        """The message, naming the setting as ``name``."""
        # "X must be ..." reads as a sentence; an underlying validator's text follows a colon.
        return (
            f"{name} {self.problem}"
            if self.problem.startswith("must ")
            else f"{name}: {self.problem}"
        )


class FleetError(AsyncGraphError, RuntimeError):
    """The local fleet could not start (no redis-server binary, workers that exit or hang)."""


# -- batch jobs (``asyncgraph.jobs``, and the ``asyncgraph run`` / ``eval`` commands) -------


class CheckpointError(AsyncGraphError):
    """A checkpoint is missing, corrupt, or belongs to a different job."""


class JobFileError(AsyncGraphError):
    """A job file that cannot be run: the one line ``asyncgraph run`` prints."""


# -- warnings -----------------------------------------------------------------------------


class NoFeedbackWarning(UserWarning):
    """A parameter given to an optimizer received no gradient in the last backward.

    Warned by ``step()``, once per such parameter per step (parameters with
    ``requires_grad=False`` excepted): the parameter is not updated. Usually it
    is not part of the graph of the loss (not passed to the calls, created under
    ``no_grad()``), or ``zero_grad()`` ran between ``backward`` and ``step``. A
    step where nothing needed fixing (e.g. a ``DeterministicEvaluator`` found
    every prediction right) warns too; silence it with
    ``warnings.simplefilter("ignore", NoFeedbackWarning)``.
    """
