"""Which commands may be sent again after their connection was lost: the one table.

A connection lost after a command was written leaves it unknown whether Redis ran
it. ``Pool.pipeline`` sends it again on a fresh connection only when that cannot do
harm: when ``unsafe_command`` finds no command of the pipeline outside this table,
or when the caller vouches for it (``retry=True``: an idempotency key, or a protocol
that joins duplicates). Everything else surfaces as ``RedisConnectionLost``.

Safe here means: running it twice leaves Redis as running it once would, and the
repeat's reply tells the caller what it needs. That admits

- reads (``GET``, ``HGETALL``, ``XRANGE``, ``XPENDING``, ``XINFO ...``, ``TIME``);
- writes that set a value rather than change it by a delta (``SET`` without ``NX``
  or ``GET``, ``HSET``, ``EXPIRE``), and removals (``DEL``, ``HDEL``, ``XACK``,
  ``XDEL``). The count such a write answers may be lower on the repeat (the first run
  removed the items): code that decides on that count passes ``retry=False``. Like any
  write, a repeat lands a little later, after what other clients wrote meanwhile;
- ``XCLAIM`` with a minimum idle time of 0 and ``JUSTID`` (a lease renewal: claims
  the same entries again without counting a delivery);
- the frame of a transaction (``MULTI``/``EXEC``): a block is as safe as its commands.

Never safe: deltas (``INCR``, ``HINCRBY``, ``RPUSH``), ``XADD`` (``*`` appends again;
an explicit id is refused the second time), ``XREADGROUP ... >`` (delivers new
entries; a lost reply leaves them pending to the consumer), ``XAUTOCLAIM`` and
``XCLAIM`` with an idle time (the repeat skips what the first run claimed),
``XGROUP CREATE`` (the repeat answers ``BUSYGROUP``), ``SET ... NX``, scripts
(``EVAL``, ``EVALSHA``: their effect is theirs to say), ``PUBLISH``, and any
command not named here.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["unsafe_command"]

Arg = bytes | str | int | float

# Safe whatever their arguments.
_SAFE = frozenset(
    {
        # connection and transaction frame
        b"ASKING",
        b"AUTH",
        b"DISCARD",
        b"ECHO",
        b"EXEC",
        b"HELLO",
        b"MULTI",
        b"PING",
        b"READONLY",
        b"READWRITE",
        b"SELECT",
        b"UNWATCH",
        b"WATCH",
        # server reads
        b"COMMAND",
        b"DBSIZE",
        b"INFO",
        b"LASTSAVE",
        b"ROLE",
        b"TIME",
        b"WAIT",
        # key reads
        b"EXISTS",
        b"KEYS",
        b"PTTL",
        b"SCAN",
        b"TTL",
        b"TYPE",
        b"GET",
        b"GETRANGE",
        b"MGET",
        b"STRLEN",
        b"HEXISTS",
        b"HGET",
        b"HGETALL",
        b"HKEYS",
        b"HLEN",
        b"HMGET",
        b"HSCAN",
        b"HVALS",
        b"LINDEX",
        b"LLEN",
        b"LRANGE",
        b"SCARD",
        b"SISMEMBER",
        b"SMEMBERS",
        b"SSCAN",
        b"ZCARD",
        b"ZRANGE",
        b"ZSCORE",
        b"XLEN",
        b"XPENDING",
        b"XRANGE",
        b"XREAD",
        b"XREVRANGE",
        b"EVAL_RO",
        b"EVALSHA_RO",
        b"FCALL_RO",
        # writes that set, and removals
        b"DEL",
        b"EXPIRE",
        b"EXPIREAT",
        b"HDEL",
        b"HMSET",
        b"HSET",
        b"MSET",
        b"PERSIST",
        b"PEXPIRE",
        b"PEXPIREAT",
        b"SADD",
        b"SREM",
        b"UNLINK",
        b"XACK",
        b"XDEL",
    }
)

# Safe with these subcommands only.
_SAFE_SUBCOMMANDS = {
    b"ACL": frozenset({b"CAT", b"GETUSER", b"LIST", b"USERS", b"WHOAMI"}),
    b"CLIENT": frozenset({b"GETNAME", b"ID", b"INFO", b"LIST", b"SETINFO", b"SETNAME"}),
    b"CLUSTER": frozenset({b"INFO", b"KEYSLOT", b"MYID", b"NODES", b"SHARDS", b"SLOTS"}),
    b"CONFIG": frozenset({b"GET", b"SET"}),
    b"SCRIPT": frozenset({b"EXISTS", b"LOAD"}),
    b"SENTINEL": frozenset({b"GET-MASTER-ADDR-BY-NAME", b"MASTERS", b"REPLICAS"}),
    b"XGROUP": frozenset({b"CREATECONSUMER", b"DELCONSUMER", b"DESTROY", b"SETID"}),
    b"XINFO": frozenset({b"CONSUMERS", b"GROUPS", b"HELP", b"STREAM"}),
}


def _upper(arg: Arg) -> bytes:
    return (arg if isinstance(arg, bytes) else str(arg).encode()).upper()


def _safe(command: Sequence[Arg]) -> bool:
    if not command:
        return True
    name = _upper(command[0])
    if name in _SAFE:
        return True
    if name in _SAFE_SUBCOMMANDS:
        return len(command) > 1 and _upper(command[1]) in _SAFE_SUBCOMMANDS[name]
    if name == b"SET":  # SET key value [options]: NX and GET answer differently the second time
        return not {_upper(a) for a in command[3:]} & {b"NX", b"GET"}
    if name == b"XCLAIM":  # XCLAIM key group consumer min-idle-time id ... [options]
        return len(command) > 4 and _upper(command[4]) == b"0" and b"JUSTID" in map(_upper, command)
    return False


def unsafe_command(commands: Sequence[Sequence[Arg]]) -> str | None:
    """The name of the first command of ``commands`` not safe to send twice, or None.

    None means the whole pipeline may be sent again after a lost connection (see the
    module's docstring for what counts as safe, and why).
    """
    for command in commands:
        if not _safe(command):
            return _upper(command[0]).decode(errors="replace") if command else ""
    return None
