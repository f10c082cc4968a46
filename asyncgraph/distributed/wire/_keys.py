"""Every Redis key, stream, consumer group and stream-entry field of the worker protocol.

The fields of the messages themselves are declared in ``_schema``.

Both the client (``asyncgraph.distributed.RedisExecutor``) and the worker import
from here; nothing else spells a key. All keys of one queue share the hash tag
``{queue}`` so a reply, an acknowledgement and a dead-letter entry touching
several of them can go in one MULTI, also on Redis Cluster.

Streams of queue ``q``::

    asyncgraph:{q}:tasks          tasks, read by the consumer group "workers"
    asyncgraph:{q}:reply:<client> one per client, read by that client's listener
    asyncgraph:{q}:cancel         cancellations, read by every worker (no group)
    asyncgraph:{q}:dead           dead letters: malformed, forged or failed tasks
    asyncgraph:{q}:workers        hash: consumer name -> heartbeat expiry (ms, Redis clock)
    asyncgraph:{q}:client:<id>    a live client's heartbeat: a string that expires unless renewed
    asyncgraph:{q}:calls:<client>:<task id>
                                  hash: the model calls a task made, kept while it can be rerun
    asyncgraph:{q}:ran:<client>:<window>
                                  hash: task id -> the sealed id of the entry running it
    asyncgraph:{q}:ran:<client>:<window>:<chunk>
                                  bitmap: one bit per task id of the chunk, set once answered
                                  (the replay memory: NOTE [Replays] in ``worker._admission``)
"""

from __future__ import annotations

import re

__all__ = [
    "BULK_MARGIN",
    "CANCEL_MAXLEN",
    "CLIENT_BEAT_MS",
    "CLIENT_TTL_MS",
    "DEAD_MAXLEN",
    "DEAD_MAX_BYTES",
    "F_MESSAGE",
    "F_SIGNATURE",
    "GROUP",
    "MAX_TTL_MS",
    "PROTOCOL_VERSION",
    "REPLY_TTL_S",
    "calls_key",
    "cancel_stream",
    "check_queue_name",
    "client_key",
    "dead_stream",
    "ran_answered_key",
    "ran_claims_key",
    "reply_stream",
    "reply_ttl_s",
    "task_stream",
    "workers_hash",
]

PROTOCOL_VERSION = 2
"""The version every message carries; a message of another version is refused.

Version 2 added a task's signed expiry (``exp``): a worker of version 2 does not run a
task without one, so version 1 clients and workers do not interoperate with it.

Example::

    print(PROTOCOL_VERSION)     # 2: clients and workers must run the same asyncgraph
"""
PREFIX = "asyncgraph"
GROUP = "workers"

# Stream entry fields: the packed msgpack message and its HMAC (empty when unsigned).
F_MESSAGE = b"m"
F_SIGNATURE = b"s"
# Unsigned hints next to the message, never trusted for anything but diagnostics and
# failing fast: a task entry names its client and task (so a dead letter says whose task
# it was, and an unsigned fleet can answer a task too big to read), a reply entry names
# its task (so a client that cannot accept a reply fails that task at once instead of
# waiting for its timeout).
F_CLIENT_HINT = b"c"
F_TASK_HINT = b"i"
# A task entry's hint that its client keeps a heartbeat key (``client_key``): workers ask
# about the clients whose entries say so, and take those of older versions for alive.
F_BEATS_HINT = b"b"

# Dead-letter entry fields.
F_REASON = b"reason"
F_ERROR = b"error"
F_TASK = b"task"
F_WORKER = b"worker"
F_ORIGINAL = b"original"
F_CLIENT = b"client"

# Dead-letter reasons.
REASON_FORGED = "forged"  # unsigned, or signed with another secret
REASON_MALFORMED = "malformed"  # failed decoding or validation
REASON_OVERSIZE = "oversize"  # larger than the worker's max_message_bytes: not read
REASON_MAX_ATTEMPTS = "max_attempts"
REASON_ERROR = "error"  # the function raised (a copy; the client got the error)
REASON_EXPIRED = "expired"  # read after its signed expiry (late, or replayed): not run
REASON_REPLAYED = "replayed"  # another entry of a task that already ran: not run again

# Bulk strings read from a stream may exceed max_message_bytes by this much (field
# names, signature): anything longer is skipped unread (see wire._resp.Oversize).
BULK_MARGIN = 4096

# A client renews its heartbeat key every CLIENT_BEAT_MS; it expires CLIENT_TTL_MS after
# its last beat, and workers skip the tasks of a client whose key is gone. Its reply
# stream lives as long as the client may wait for a reply in it: the client's beat and
# every reply a worker writes set its expiry to the task's timeout (``reply_ttl_s``), so
# a reply outlives any stall of its client shorter than the client's deadline. A reply
# to a task whose timeout cannot be read (it did not decode) keeps the stream
# REPLY_TTL_S, the default client timeout.
CLIENT_BEAT_MS = 500
CLIENT_TTL_MS = 2000
REPLY_TTL_S = 600
# The longest a client may wait for one task (``TaskMessage.ttl_ms``): a task that says
# longer is refused, so the replay memory it needs is bounded (and Redis takes its expiry).
MAX_TTL_MS = 7 * 24 * 3600 * 1000
# Caps: these streams are diagnostic or short-lived, never the only copy of work. The
# dead-letter stream is bounded by bytes as well (see ``worker._outcomes.dead_maxlen``).
CANCEL_MAXLEN = 10_000
DEAD_MAXLEN = 10_000
DEAD_MAX_BYTES = 8 * 1024 * 1024

# The client id of the keys a worker writes to check its Redis user at start (the call
# journal's probe): no client has it (a client's id is random).
PROBE_CLIENT = "0" * 32

_QUEUE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_CLIENT_RE = re.compile(r"[0-9a-f]{32}")


def check_queue_name(queue: str) -> str:
    """Return ``queue`` if it is a valid queue name (1-64 of ``A-Za-z0-9_.-``), else raise.

    Example::

        check_queue_name("grads")           # 'grads'
        check_queue_name("my queue")        # ValueError: not a valid queue name
    """
    if not isinstance(queue, str) or not _QUEUE_RE.fullmatch(queue):
        raise ValueError(
            f"queue name must be 1 to 64 characters among A-Z a-z 0-9 _ . -, got {queue!r}"
        )
    return queue


def is_client_id(client: str) -> bool:
    return _CLIENT_RE.fullmatch(client) is not None


def _base(queue: str) -> str:
    return f"{PREFIX}:{{{queue}}}"


def task_stream(queue: str) -> str:
    return f"{_base(queue)}:tasks"


def reply_stream(queue: str, client: str) -> str:
    """The reply stream of one client; ``client`` is a validated 32-hex-digit id."""
    if not is_client_id(client):
        raise ValueError(f"client id must be 32 lowercase hex digits, got {client!r}")
    return f"{_base(queue)}:reply:{client}"


def cancel_stream(queue: str) -> str:
    return f"{_base(queue)}:cancel"


def dead_stream(queue: str) -> str:
    return f"{_base(queue)}:dead"


def workers_hash(queue: str) -> str:
    return f"{_base(queue)}:workers"


def workers_info_hash(queue: str) -> str:
    """Each live worker's self-description (JSON: host, pid, concurrency, in flight,
    version, draining, started), written with its heartbeat, read by ``asyncgraph status``."""
    return f"{_base(queue)}:workers:info"


def client_key(queue: str, client: str) -> str:
    """The heartbeat key of one client (``client``: a validated 32-hex-digit id): it exists
    while the client is alive, and expires ``CLIENT_TTL_MS`` after its last beat."""
    if not is_client_id(client):
        raise ValueError(f"client id must be 32 lowercase hex digits, got {client!r}")
    return f"{_base(queue)}:client:{client}"


def calls_key(queue: str, client: str, task_id: str) -> str:
    """The call journal of one task (a hash: call -> its answer), which a rerun of the task
    after a crash replays instead of paying for the calls again (``TaskInfo.journal_key``;
    ``client``: a validated 32-hex-digit id)."""
    if not is_client_id(client):
        raise ValueError(f"client id must be 32 lowercase hex digits, got {client!r}")
    return f"{_base(queue)}:calls:{client}:{task_id}"


def reply_ttl_s(ttl_ms: int | None) -> int:
    """Seconds a reply stream is kept after a write, for a task whose client waits ``ttl_ms``
    (None: not known): the client's timeout plus a second, so the reply outlives any stall
    of the client shorter than its deadline; ``REPLY_TTL_S`` when not known."""
    if ttl_ms is None:
        return REPLY_TTL_S
    return -(-min(ttl_ms, MAX_TTL_MS) // 1000) + 1


def ran_claims_key(queue: str, client: str, window: int) -> str:
    """The replay memory's claims of one client's tasks expiring in ``window``: a hash, task
    id -> the sealed id of the stream entry that runs it, while it runs (NOTE [Replays] in
    ``worker._admission``; ``client``: a validated 32-hex-digit id)."""
    if not is_client_id(client):
        raise ValueError(f"client id must be 32 lowercase hex digits, got {client!r}")
    return f"{_base(queue)}:ran:{client}:{window}"


def ran_answered_key(queue: str, client: str, window: int, chunk: int) -> str:
    """The replay memory's marks of one client's answered tasks expiring in ``window`` whose
    task numbers fall in ``chunk``: a bitmap, one bit per task (NOTE [Replays])."""
    return f"{ran_claims_key(queue, client, window)}:{chunk}"
