"""What the client's own byte streams share: a deadline on their waits, not a cancel scope.

``anyio.fail_after`` costs about 6 us a command (a generator, a cancel scope, its timer):
a tenth of a worker's CPU for a no-op task. A lean stream checks ``deadline`` (on its
event loop's clock) only when it must wait, and raises ``TimeoutError`` past it.
``Connection.pipeline`` sets it for the commands of one call.
"""

from __future__ import annotations

import anyio.abc

__all__ = ["LeanStream"]


class LeanStream(anyio.abc.ByteStream):
    deadline: float | None = None  # on ``time()``'s clock; None: wait as long as it takes

    def time(self) -> float:
        """The event loop's clock, which ``deadline`` is on."""
        raise NotImplementedError
