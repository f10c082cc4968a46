"""Response caches: memory, a directory on disk, or Redis (with a TTL).

A cache maps a request digest (``digest_request``: the sha256 of the full request as
sent, see ``BaseChatModel.cache_request``) to a ``Completion`` stored as JSON; nothing is
ever pickled. An entry that cannot be read back (corrupt file, foreign value) is a miss
and is overwritten by the next answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio.to_thread

from asyncgraph._exceptions import ModelBackendError
from asyncgraph._files import write_private_json
from asyncgraph.models._keys import CACHE_PREFIX, cache_key
from asyncgraph.models._redis import RedisHandle
from asyncgraph.models._types import Completion

__all__ = ["Cache", "DiskCache", "MemoryCache", "RedisCache", "digest_request", "request_key"]


def digest_request(request: Mapping[str, Any]) -> str:
    """The sha256 hex digest of ``request`` (JSON data), the key of its cached answer.

    The request is serialized as canonical JSON (sorted keys, no spaces), so dict order
    does not matter. Raises ``TypeError`` if a value is not JSON-serializable.
    """
    try:
        text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except TypeError as exc:
        raise TypeError(
            f"cannot cache a request whose params are not JSON-serializable ({exc}); "
            "pass cache=False for this call"
        ) from exc
    return hashlib.sha256(text.encode()).hexdigest()


def request_key(
    endpoint: str, model: str, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> str:
    """The sha256 hex digest of a request: endpoint, model, messages and params.

    What ``BaseChatModel.cache_request`` hashes by default; ``params`` must be every
    parameter sent (a client's defaults included). Raises ``TypeError`` if a param is
    not JSON-serializable.
    """
    return digest_request(
        {"endpoint": endpoint, "model": model, "messages": messages, "params": params}
    )


def _decode(raw: bytes | str) -> Completion | None:
    try:
        data = json.loads(raw)
        return Completion.from_dict(data) if isinstance(data, dict) else None
    except ValueError:
        return None


def _encode(completion: Completion) -> bytes:
    return json.dumps(completion.to_dict(), ensure_ascii=False).encode()


@runtime_checkable
class Cache(Protocol):
    """A response cache backend.

    ``await get(key)`` returns the stored ``Completion`` or ``None``; ``await set(key,
    completion)`` stores it; ``await delete(key)`` removes it (no error if absent);
    ``await aclose()`` releases connections (the cache stays usable). Backend failures
    raise ``ModelBackendError``.

    Example::

        model = OpenAIChat("gpt-4o-mini", cache=DiskCache(".cache/models"))
        first = await model.complete(messages)
        again = await model.complete(messages)    # same messages and params
        print(again.cached)                       # True: no request was sent
    """

    async def get(self, key: str) -> Completion | None: ...

    async def set(self, key: str, completion: Completion) -> None: ...

    async def delete(self, key: str) -> None: ...

    async def aclose(self) -> None: ...


class MemoryCache:
    """An in-process cache; with ``max_entries`` it evicts the least recently used entry.

    Example::

        model = SimulatedModel(cache=MemoryCache(max_entries=10_000))
        await model.complete(messages)
        print((await model.complete(messages)).cached)    # True
    """

    def __init__(self, max_entries: int | None = None) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be >= 1 or None, got {max_entries!r}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Completion] = OrderedDict()

    async def get(self, key: str) -> Completion | None:
        with self._lock:
            completion = self._entries.get(key)
            if completion is not None:
                self._entries.move_to_end(key)
            return completion

    async def set(self, key: str, completion: Completion) -> None:
        with self._lock:
            self._entries[key] = completion
            self._entries.move_to_end(key)
            if self.max_entries is not None:
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)

    async def delete(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    async def aclose(self) -> None:
        return None


class DiskCache:
    """One JSON file per entry under ``directory`` (``ab/abcdef....json``).

    Writes are atomic (a temporary file in the same directory, fsynced, then
    ``os.replace``), so concurrent processes sharing the directory never read a
    half-written entry; entries are 0600 and new directories 0700, their text redacted,
    as every file asyncgraph writes. File I/O runs in a worker thread. Entries never
    expire: delete the directory to clear it.

    Example::

        model = OpenAIChat("gpt-4o-mini", cache=DiskCache(".cache/models"))
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path_for(self, key: str) -> Path:
        if len(key) < 3 or not key.isalnum():
            raise ValueError(f"cache keys are hex digests, got {key!r}")
        return self.directory / key[:2] / f"{key}.json"

    async def get(self, key: str) -> Completion | None:
        path = self.path_for(key)

        def read() -> bytes | None:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

        try:
            raw = await anyio.to_thread.run_sync(read)
        except OSError as exc:
            raise ModelBackendError(f"cannot read cache entry {str(path)!r}: {exc}") from exc
        return None if raw is None else _decode(raw)

    async def set(self, key: str, completion: Completion) -> None:
        path = self.path_for(key)
        entry = completion.to_dict()  # what _decode reads

        def write() -> None:  # as every file asyncgraph writes: redacted, 0600, atomic
            write_private_json(path, entry)

        try:
            await anyio.to_thread.run_sync(write)
        except OSError as exc:
            raise ModelBackendError(f"cannot write cache entry {str(path)!r}: {exc}") from exc

    async def delete(self, key: str) -> None:
        path = self.path_for(key)
        try:
            await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
        except OSError as exc:
            raise ModelBackendError(f"cannot delete cache entry {str(path)!r}: {exc}") from exc

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"DiskCache({str(self.directory)!r})"


class RedisCache:
    """Entries in Redis under ``prefix + key``, expiring after ``ttl_s`` (``None`` = never).

    Shared by every process using the same Redis. Each call times out after
    ``timeout_s`` and raises ``ModelBackendError`` when Redis fails.

    Example::

        cache = RedisCache("redis://127.0.0.1:6379/0", ttl_s=24 * 3600)
        model = OpenAIChat("gpt-4o-mini", cache=cache)    # shared by every worker
    """

    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: float | None = 7 * 24 * 3600.0,
        prefix: str = CACHE_PREFIX,
        timeout_s: float = 5.0,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        self.ttl_s = ttl_s
        self.prefix = prefix
        self._redis = RedisHandle(redis_url, timeout_s=timeout_s, purpose="the response cache")

    async def get(self, key: str) -> Completion | None:
        name = cache_key(key, self.prefix)

        value = await self._redis.call("GET", name)
        raw = value if isinstance(value, bytes) else None
        return None if raw is None else _decode(raw)

    async def set(self, key: str, completion: Completion) -> None:
        name = cache_key(key, self.prefix)
        data = _encode(completion)
        px = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

        await self._redis.call("SET", name, data, *(["PX", px] if px is not None else []))

    async def delete(self, key: str) -> None:
        name = cache_key(key, self.prefix)

        await self._redis.call("DEL", name)

    async def aclose(self) -> None:
        await self._redis.aclose()

    def __repr__(self) -> str:
        return f"RedisCache(ttl_s={self.ttl_s!r}, prefix={self.prefix!r})"
