"""Run several model requests at once and fail like one of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

__all__ = ["run_all"]


async def run_all(jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run ``jobs`` concurrently in one task group (asyncio or trio).

    When a job raises, the others are cancelled and the error of the failing job
    with the lowest index is re-raised as is (not inside an ``ExceptionGroup``),
    so callers and the engine see e.g. the ``ModelError`` itself. Cancellation
    of the caller propagates untouched.

    Example::

        answers = [None] * len(questions)

        async def ask(i):
            answers[i] = await llm_call(prompt, questions[i], model="simulated")

        await run_all([functools.partial(ask, i) for i in range(len(questions))])
    """
    if len(jobs) == 1:
        await jobs[0]()
        return
    errors: dict[int, Exception] = {}

    async with anyio.create_task_group() as tg:

        async def run(i: int, job: Callable[[], Awaitable[None]]) -> None:
            try:
                await job()
            except Exception as exc:
                errors[i] = exc
                tg.cancel_scope.cancel()

        for i, job in enumerate(jobs):
            tg.start_soon(run, i, job)
    if errors:
        raise errors[min(errors)]
