"""The model policy on the fleet, installed as a task hook when ``asyncgraph.models`` loads.

- on a worker, serving: only the allowed base URLs (``--allow-base-url``, plus the
  providers' default URLs and ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``,
  ``AZURE_OPENAI_ENDPOINT``) may receive the worker's own API keys when a task names a
  model by spec;
- around each task: the model usage its calls spent goes back with the reply, and its
  calls are journaled in the fleet's Redis, so a rerun after a crash replays the answers
  already paid for (see NOTE [Call journal] in ``_journal``);
- on the client: that usage is counted by the caller's ``track_usage()`` blocks, as
  if the calls had been made here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asyncgraph.models._journal import _JOURNAL, CallJournal, JournalStore, check_journal
from asyncgraph.models._spec import restrict_base_urls
from asyncgraph.models._usage import _SINKS, Usage, UsageMeter, meters_for
from asyncgraph.taskhooks import install_task_hook

__all__ = ["ModelPolicy"]


class ModelPolicy:
    """The task hook of the model layer (installed on import; see ``asyncgraph.taskhooks``)."""

    name = "models"

    def __init__(self) -> None:
        self._store: JournalStore | None = None  # while a worker serves: its Redis
        self._probe_key = ""  # where the worker's start-up probe of the journal writes

    def serving(self, settings: Mapping[str, Any]) -> Callable[[], None]:
        restriction = restrict_base_urls(tuple(settings.get("allowed_base_urls", ())))
        before = self._store, self._probe_key
        url, timeout_s = settings.get("redis_url"), settings.get("redis_timeout_s", 5.0)
        # No journal without the fleet's seal: a record that cannot be verified is not read.
        seal, on_ignored = settings.get("record_seal"), settings.get("on_ignored_record")
        if (
            isinstance(url, str)
            and isinstance(timeout_s, (int, float))
            and timeout_s > 0
            and seal is not None
        ):
            counter = on_ignored if callable(on_ignored) else None
            self._store = JournalStore(url, float(timeout_s), seal, counter)
            self._probe_key = str(settings.get("journal_probe_key", ""))

        def undo() -> None:
            self._store, self._probe_key = before
            restriction.remove()

        return undo

    async def probe(self) -> None:
        """Once a worker serves, before its first task: ``ConfigError`` when its Redis user
        cannot write and read the call journal (see ``check_journal``)."""
        if self._store is not None and self._probe_key:
            await check_journal(self._store, self._probe_key)

    def task_metadata(self) -> None:
        return None  # the worker needs nothing from the client to count usage

    def around_task(self, metadata: Any, info: Any) -> _CountUsage:
        store = self._store
        key, rerun_s = getattr(info, "journal_key", ""), getattr(info, "rerun_s", 0.0)
        if store is None or not key or rerun_s <= 0:
            return _CountUsage(None)
        return _CountUsage(CallJournal(store, key, ttl_s=rerun_s, rerun=info.delivery > 1))

    def on_reply(self, metadata: Any) -> None:
        if not isinstance(metadata, dict):
            raise TypeError("model usage must be a map of counters")
        spent = Usage.from_dict(metadata)  # ValueError on a counter out of range, a NaN cost
        for meter in meters_for():
            meter.add(spent)


class _CountUsage:
    """Around one task on a worker: counts its model calls and makes ``journal`` the
    current call journal; the value gives what the calls spent.

    A plain class, not ``track_usage``'s generator: it runs around every task a worker
    runs, most of which call no model.
    """

    __slots__ = ("_journal", "_journal_token", "_meter", "_token")

    def __init__(self, journal: CallJournal | None) -> None:
        self._journal = journal

    def __enter__(self) -> Callable[[], dict[str, int | float] | None]:
        self._meter = UsageMeter()
        self._token = _SINKS.set((*_SINKS.get(), self._meter))
        self._journal_token = _JOURNAL.set(self._journal)
        return self.spent

    def __exit__(self, *exc_info: object) -> None:
        _JOURNAL.reset(self._journal_token)
        _SINKS.reset(self._token)

    def spent(self) -> dict[str, int | float] | None:
        snapshot = self._meter.snapshot()
        return None if snapshot == _NOTHING else snapshot.to_dict()


_NOTHING = Usage()

install_task_hook(ModelPolicy())
