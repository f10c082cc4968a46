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
    │   ├── ModelContextError                             a request does not fit the context
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
    ├── NoFeedbackWarning                                 a parameter got no gradient
    └── ReplySkippedWarning                               a reply that never parsed was skipped

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
    "ModelContextError",
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
    "ReplySkippedWarning",
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
    """Base class of every asyncgraph error.

    Example::

        try:
            await loss.backward()
        except AsyncGraphError as e:   # any failure asyncgraph raises, of any package
            print(type(e).__name__, e)
    """


# -- the core (exported by ``asyncgraph``) ------------------------------------------------


class GraphError(AsyncGraphError, RuntimeError):
    """The graph cannot be used as asked: a freed graph, inputs that do not require grad,
    a hook on a variable without grad, a ``GradManager`` not recording.

    A ``RuntimeError`` too, as PyTorch raises for the same misuse.

    Example::

        y = Double.apply(Parameter(3.0))
        await y.backward()
        try:
            await y.backward()         # the first backward freed the graph
        except GraphError as e:
            print(e)                   # "... Specify retain_graph=True on the first backward ..."
    """


class BackwardError(AsyncGraphError, RuntimeError):
    """A node's backward failed; ``__cause__`` is the original exception.

    ``function`` is the Function's name, ``input_roles`` / ``output_roles`` the
    roles of the variables it connects.

    Example::

        try:
            await loss.backward()
        except BackwardError as e:     # no .grad was changed
            print(e.function, e.input_roles, repr(e.__cause__))
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
    """A backward that ran on a worker failed; ``remote_traceback`` is its text.

    Example::

        try:
            await loss.backward(executor=ex)    # ex: open_redis_executor(...)
        except RemoteError as e:
            print(e.function, e.remote_traceback)
    """

    def __init__(self, message: str, *, remote_traceback: str = "", **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.remote_traceback = remote_traceback


class RemoteConnectionError(BackwardError, ConnectionError):
    """Redis could not be reached or went away while a node's backward was remote.

    Example::

        try:
            await loss.backward(executor=ex)
        except RemoteConnectionError as e:     # Redis down: retry the pass later
            print(e.function, e)
    """


class RemoteTimeoutError(BackwardError, TimeoutError):
    """No worker answered for a remote node within the executor's timeout.

    Example::

        try:
            await loss.backward(executor=ex)
        except RemoteTimeoutError as e:        # no worker serving the queue, or all too slow
            print(e)                           # says whether the task was queued or being run
    """


class WireError(AsyncGraphError, ValueError):
    """A message crossing a process boundary is malformed, too large or forged.

    Example::

        # Raised inside the fleet: a worker refuses a task whose message breaks its limits
        # (--max-message-bytes ...) and answers why; the client raises that as a RemoteError.
        try:
            await loss.backward(executor=ex)
        except RemoteError as e:
            print(e)          # "... refused the task: ...; send less data or raise --max-message-bytes"
    """


# -- the RESP client (exported by ``asyncgraph.resp``) ------------------------------------


class RedisConnectionLost(AsyncGraphError, ConnectionError):
    """Redis could not be reached, went away mid-call, or did not answer in time.

    Example::

        pool = Pool(parse_redis_url("redis://127.0.0.1:9/0"), timeout_s=1.0)
        try:
            await pool.execute("PING")
        except RedisConnectionLost as e:     # nothing listens on port 9
            print(e)                         # cannot connect to Redis at redis://127.0.0.1:9/0: ...
    """


class ReplyError(AsyncGraphError):
    """An error reply of the Redis server (``-ERR ...``, ``-NOGROUP ...``).

    Example::

        await pool.execute("SET", "greeting", "hello")
        try:
            await pool.execute("INCR", "greeting")
        except ReplyError as e:
            print(e.code)                    # ERR (value is not an integer or out of range)
    """

    @property
    def code(self) -> str:
        """The reply's first word: ``ERR``, ``NOGROUP``, ``MOVED`` ..."""
        return str(self).split(" ", 1)[0]


# -- the model clients (exported by ``asyncgraph.models``) --------------------------------


class ModelError(AsyncGraphError):
    """A model call failed. ``model`` names the model, ``retryable`` says if retrying may help.

    ``retryable`` is what the retry middleware goes by.

    Example::

        try:
            answer = await model.complete([{"role": "user", "content": "Hi"}])
        except ModelError as e:
            print(e.model, e.retryable, e)
    """

    retryable: bool = False

    def __init__(self, message: str, *, model: str = "") -> None:
        super().__init__(message)
        self.model = model


class ModelStatusError(ModelError):
    """The server answered with HTTP ``status_code``; ``server_message`` is its error text.

    Example::

        try:
            answer = await OpenAIChat("gpt-4o-mini", retry=Retry(max_attempts=1)).complete(messages)
        except ModelStatusError as e:
            print(e.status_code, e.server_message)
    """

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

    Example::

        try:
            answer = await OpenAIChat("no-such-model").complete(messages)
        except ModelRequestError as e:      # raised on the first attempt, never retried
            print(e.status_code, e.server_message)     # 404 and the server's text
    """

    retryable = False


class ModelRequestTimeoutError(ModelStatusError):
    """A 408 answer: the server stopped waiting for the request (e.g. a slow upload); retried.

    Example::

        model = OpenAIChat("gpt-4o-mini", retry=Retry(max_attempts=1))   # no retries
        try:
            answer = await model.complete(messages)
        except ModelRequestTimeoutError as e:
            print(e.status_code)                       # 408
    """

    retryable = True


class ModelRateLimitedError(ModelStatusError):
    """A 429 answer; ``retry_after_s`` is the server's Retry-After, if it sent one.

    Example::

        model = OpenAIChat("gpt-4o-mini", retry=Retry(max_attempts=1))   # no retries
        try:
            answer = await model.complete(messages)
        except ModelRateLimitedError as e:
            print(e.status_code, e.retry_after_s)      # 429 and the server's Retry-After
    """

    retryable = True


class ModelServerError(ModelStatusError):
    """A 5xx answer: the server failed, retrying may help.

    Example::

        model = OpenAIChat("gpt-4o-mini", retry=Retry(max_attempts=1))   # no retries
        try:
            answer = await model.complete(messages)
        except ModelServerError as e:
            print(e.status_code, e.server_message)     # 500, 502, 503 ...
    """

    retryable = True


class ModelConnectionError(ModelError):
    """The connection could not be opened or was lost before an answer arrived.

    Example::

        model = OpenAIChat("llama3", base_url="http://127.0.0.1:9/v1", retry=Retry(max_attempts=1))
        try:
            answer = await model.complete(messages)
        except ModelConnectionError as e:              # nothing listens on that port
            print(e.model, e)
    """

    retryable = True


class ModelTimeoutError(ModelError):
    """One attempt did not finish within its deadline (``timeout_s``).

    Example::

        model = OpenAIChat("gpt-4o-mini", timeout_s=5.0, retry=Retry(max_attempts=1))
        try:
            answer = await model.complete(messages)
        except ModelTimeoutError as e:                 # the attempt took more than 5 s
            print(e)
    """

    retryable = True
    backoff_done: bool = False
    """True when the attempt already waited out its retry's backoff (in its server slot)."""


class ModelContextError(ModelError):
    """A request does not fit the model's context window: refused by the client before it
    was sent (``status_code`` None), or by the server (llama.cpp's
    ``exceed_context_size_error``, vLLM's "maximum context length"; ``status_code`` 400).

    ``prompt_tokens`` is the request's size (the server's count, or the client's
    estimate), ``context_tokens`` the window, ``reply_tokens`` the room the reply needed;
    each None when unknown. Not retried: the same request would not fit again.

    Example::

        try:
            answer = await model.complete(messages)
        except ModelContextError as e:      # set context_tokens=, or send less
            print(e.prompt_tokens, e.context_tokens, e)
    """

    retryable = False

    def __init__(
        self,
        message: str,
        *,
        model: str = "",
        prompt_tokens: int | None = None,
        context_tokens: int | None = None,
        reply_tokens: int | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message, model=model)
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens
        self.reply_tokens = reply_tokens
        self.status_code = status_code


class ModelResponseError(ModelError):
    """The answer is not a readable chat completion: a 2xx with another body, or a body
    that cannot be decoded (bad compression, too many redirects).

    Example::

        try:
            answer = await model.complete(messages)
        except ModelResponseError as e:     # e.g. a proxy's HTML page instead of JSON
            print(e.model, e)
    """

    retryable = False


class ModelRetryError(ModelError):
    """Every one of ``attempts`` attempts failed; ``__cause__`` / ``last_error`` is the last one.

    Example::

        model = OpenAIChat("gpt-4o-mini", retry=Retry(max_attempts=3))
        try:
            answer = await model.complete(messages)
        except ModelRetryError as e:
            print(e.attempts, type(e.last_error).__name__)   # 3 ModelServerError
    """

    retryable = False

    def __init__(self, message: str, *, model: str = "", attempts: int, last_error: ModelError):
        super().__init__(message, model=model)
        self.attempts = attempts
        self.last_error = last_error


class RateLimitWaitError(ModelError):
    """The rate limiter would make this call wait ``wait_s`` > ``max_wait_s``; nothing was reserved.

    Example::

        limiter = LocalRateLimiter(RateLimit(requests_per_minute=1, max_wait_s=1))
        await limiter.acquire()
        try:
            await limiter.acquire()          # the next slot is a minute away
        except RateLimitWaitError as e:
            print(e.wait_s, e.max_wait_s)    # about 60.5 and 1; nothing was booked
    """

    retryable = False

    def __init__(self, message: str, *, model: str = "", wait_s: float, max_wait_s: float):
        super().__init__(message, model=model)
        self.wait_s = wait_s
        self.max_wait_s = max_wait_s


class ModelBackendError(ModelError):
    """A shared backend (Redis for a rate limit or cache, a cache directory) failed or timed out.

    Example::

        model = OpenAIChat("gpt-4o-mini", cache=RedisCache("redis://127.0.0.1:6379/0"))
        try:
            answer = await model.complete(messages)
        except ModelBackendError as e:      # Redis is down or did not answer within timeout_s
            print(e)
    """

    retryable = False


class ModelConfigError(ModelError, ValueError):
    """A model setting is invalid or missing: an environment variable
    (``ASYNCGRAPH_MODEL_*``, ``OPENAI_API_KEY``, ``OPENAI_BASE_URL``) or an option given to
    a model (``base_url``), found where the model is built, before any call.

    ``variable`` names the setting, ``value`` is what it held.

    Example::

        os.environ["ASYNCGRAPH_MODEL_RPM"] = "fast"
        try:
            parse_model_spec("openai:gpt-4o-mini")
        except ModelConfigError as e:
            print(e.variable, e.value)       # ASYNCGRAPH_MODEL_RPM fast
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

    Example::

        try:
            resolve_model("house-model")     # never registered, and not a spec
        except UnknownModelError as e:
            print(e.spec, e.base_url)        # house-model None
    """

    def __init__(self, message: str, *, spec: str, base_url: str | None = None) -> None:
        super().__init__(message)
        self.spec = spec
        self.base_url = base_url


class StructuredOutputError(AsyncGraphError, ValueError):
    """A reply never followed its ``response_format`` schema.

    ``path`` is where the last reply failed (``$`` the whole reply, ``$.steps[2]`` ...),
    ``reply`` its text, ``attempts`` how many replies were tried.

    Example::

        @dataclass
        class Answer:
            value: int

        try:
            answer = await llm_call(prompt, question, model=model, response_format=Answer)
        except StructuredOutputError as e:
            print(e.path, e.attempts, e.reply)
    """

    def __init__(self, message: str, *, path: str, reply: str, attempts: int) -> None:
        super().__init__(message)
        self.path = path
        self.reply = reply
        self.attempts = attempts


# -- optimizers (exported by ``asyncgraph.optim``) ----------------------------------------


class OptimizerError(AsyncGraphError):
    """An optimizer step failed; no parameter was changed by that step.

    Example::

        try:
            await tgd.step()
        except OptimizerError as e:      # the parameters keep their values
            print(e)
    """


class UpdateParseError(OptimizerError, ValueError):
    """Every attempt's reply lacked the tags around the improved value.

    ``role`` is the parameter's role, ``attempts`` how many replies were tried,
    ``reply`` the last reply (in full; the message shows an excerpt).

    Example::

        try:
            await tgd.step()
        except UpdateParseError as e:    # no <IMPROVED_VARIABLE> tags in any reply
            print(e.role, e.attempts, e.reply)
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

    Example::

        try:
            WorkerConfig(redis_url="redis://127.0.0.1:6379/0", concurrency=0)
        except ConfigError as e:
            print(e.field, e.problem)        # concurrency must be >= 1, got 0
            print(e.with_name("--concurrency"))   # --concurrency must be >= 1, got 0
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
    """The local fleet could not start (no redis-server binary, workers that exit or hang).

    Example::

        try:
            wait_for_workers(server.url, "grads", 2, timeout_s=30)
        except FleetError as e:
            print(e)     # 2 worker(s) of queue 'grads' did not start within 30s
    """


# -- batch jobs (``asyncgraph.jobs``, and the ``asyncgraph run`` / ``eval`` commands) -------


class CheckpointError(AsyncGraphError):
    """A checkpoint is missing, corrupt, or belongs to a different job.

    Example::

        await run_job(job, "runs/demo")
        try:
            await run_job(job, "runs/demo")      # the same directory again
        except CheckpointError as e:
            print(e)     # "... already holds a checkpoint: continue that job with resume=True ..."
    """


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

    Example::

        with warnings.catch_warnings():
            warnings.simplefilter("error", NoFeedbackWarning)
            await tgd.step()     # raises if a parameter got no gradient from the backward
    """


class ReplySkippedWarning(UserWarning):
    """A model's reply could not be parsed after its attempts, and was skipped instead of
    ending the run: an optimizer's update (the parameter keeps its value; ``TGD(strict=True)``
    raises ``UpdateParseError`` instead), or, in a job, a judge's verdict that never fit its
    ``response_format`` (the example counts as not passed; ``Job(strict=True)`` raises).

    Example::

        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplySkippedWarning)
            await tgd.step()     # raises if an update was skipped
    """
