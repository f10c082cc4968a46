"""The model policy on the fleet, installed as a task hook when ``asyncgraph.models`` loads.

- on a worker, serving: only the allowed base URLs (``--allow-base-url``, plus the
  providers' default URLs and ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``,
  ``AZURE_OPENAI_ENDPOINT``) may receive the worker's own API keys when a task names a
  model by spec;
- around each task: the model usage its calls spent goes back with the reply;
- on the client: that usage is counted by the caller's ``track_usage()`` blocks, as
  if the calls had been made here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asyncgraph.models._spec import restrict_base_urls
from asyncgraph.models._usage import _SINKS, Usage, UsageMeter, meters_for
from asyncgraph.taskhooks import install_task_hook

__all__ = ["ModelPolicy"]


class ModelPolicy:
    """The task hook of the model layer (installed on import; see ``asyncgraph.taskhooks``)."""

    name = "models"

    def serving(self, settings: Mapping[str, Any]) -> Callable[[], None]:
        return restrict_base_urls(tuple(settings.get("allowed_base_urls", ()))).remove

    def task_metadata(self) -> None:
        return None  # the worker needs nothing from the client to count usage

    def around_task(self, metadata: Any, info: Any) -> _CountUsage:
        return _CountUsage()

    def on_reply(self, metadata: Any) -> None:
        if not isinstance(metadata, dict):
            raise TypeError("model usage must be a map of counters")
        spent = Usage.from_dict(metadata)  # ValueError on an unknown or negative counter
        for meter in meters_for():
            meter.add(spent)


class _CountUsage:
    """Around one task on a worker: counts its model calls; the value gives what they spent.

    A plain class, not ``track_usage``'s generator: it runs around every task a worker
    runs, most of which call no model.
    """

    __slots__ = ("_meter", "_token")

    def __enter__(self) -> Callable[[], dict[str, int | float] | None]:
        self._meter = UsageMeter()
        self._token = _SINKS.set((*_SINKS.get(), self._meter))
        return self.spent

    def __exit__(self, *exc_info: object) -> None:
        _SINKS.reset(self._token)

    def spent(self) -> dict[str, int | float] | None:
        snapshot = self._meter.snapshot()
        return None if snapshot == _NOTHING else snapshot.to_dict()


_NOTHING = Usage()

install_task_hook(ModelPolicy())
