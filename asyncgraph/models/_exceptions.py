"""Exceptions raised by the model clients (``asyncgraph.models``).

Hierarchy. ``ModelError`` is the root: the model clients are a standalone package that
imports nothing else of asyncgraph, so their errors do not derive from the core's
``AsyncGraphError`` (catch ``(AsyncGraphError, ModelError)`` for both)::

    Exception
    └── ModelError                        a model call failed
        ├── ModelStatusError              the server answered with an HTTP error status
        │   ├── ModelRequestError         other 4xx: the request is wrong; never retried
        │   ├── ModelRequestTimeoutError  408: the server gave up waiting; retried
        │   ├── ModelRateLimitedError     429: retried, honouring Retry-After
        │   └── ModelServerError          5xx: retried
        ├── ModelConnectionError          could not connect / connection lost: retried
        ├── ModelTimeoutError             the per-attempt deadline (timeout_s) passed: retried
        ├── ModelResponseError            the answer is not a readable chat completion; not retried
        ├── ModelRetryError               every attempt failed; ``__cause__`` is the last error
        ├── RateLimitWaitError            the rate limiter's wait would exceed ``max_wait_s``
        ├── ModelBackendError             Redis or disk failed under a limiter or a cache
        └── ModelConfigError              a model setting (env, key, base_url) is invalid

``retryable`` on every ``ModelError`` says whether the retry middleware tries
again. Cancellation is never wrapped: it propagates untouched.
"""

from __future__ import annotations

__all__ = [
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
    "RateLimitWaitError",
]


class ModelError(Exception):
    """A model call failed. ``model`` names the model, ``retryable`` says if retrying may help."""

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
