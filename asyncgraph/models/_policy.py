"""The model policy on the fleet, installed as a task hook when ``asyncgraph.models`` loads.

- on a worker, serving: only the allowed base URLs (``--allow-base-url``, plus the
  default OpenAI URL and ``OPENAI_BASE_URL``) may receive the worker's own API key
  when a task names a model by spec;
- around each task: the model usage its calls spent goes back with the reply;
- on the client: that usage is counted by the caller's ``track_usage()`` blocks, as
  if the calls had been made here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from asyncgraph.models._spec import restrict_base_urls
from asyncgraph.models._usage import Usage, meters_for, track_usage
from asyncgraph.taskhooks import install_task_hook

__all__ = ["ModelPolicy"]


class ModelPolicy:
    """The task hook of the model layer (installed on import; see ``asyncgraph.taskhooks``)."""

    name = "models"

    def serving(self, settings: Mapping[str, Any]) -> Callable[[], None]:
        return restrict_base_urls(tuple(settings.get("allowed_base_urls", ()))).remove

    def task_metadata(self) -> None:
        return None  # the worker needs nothing from the client to count usage

    @contextmanager
    def around_task(self, metadata: Any, info: Any) -> Iterator[Callable[[], Any]]:
        with track_usage() as usage:

            def spent() -> dict[str, int | float] | None:
                snapshot = usage.snapshot()
                return snapshot.to_dict() if snapshot != Usage() else None

            yield spent

    def on_reply(self, metadata: Any) -> None:
        if not isinstance(metadata, dict):
            raise TypeError("model usage must be a map of counters")
        spent = Usage.from_dict(metadata)  # ValueError on an unknown or negative counter
        for meter in meters_for():
            meter.add(spent)


install_task_hook(ModelPolicy())
