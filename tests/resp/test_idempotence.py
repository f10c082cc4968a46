"""Which commands the pool sends again after a lost connection: the table, without Redis."""

from __future__ import annotations

import pytest

from asyncgraph.resp._idempotence import unsafe_command


@pytest.mark.parametrize(
    "command",
    [
        ["GET", "k"],
        [b"hgetall", b"h"],
        ["XRANGE", "s", "-", "+"],
        ["XPENDING", "s", "g", "-", "+", 1],
        ["XINFO", "CONSUMERS", "s", "g"],
        ["XREAD", "BLOCK", 10, "STREAMS", "s", "0-0"],
        ["TIME"],
        ["SET", "k", "v"],
        ["SET", "k", "v", "PX", 1000],
        ["HSET", "h", "f", 1],
        ["DEL", "a", "b"],
        ["EXPIRE", "k", 60],
        ["XACK", "s", "g", "1-0"],
        ["XDEL", "s", "1-0"],
        ["XGROUP", "DELCONSUMER", "s", "g", "c"],
        ["XCLAIM", "s", "g", "c", 0, "1-0", "JUSTID"],
        ["XCLAIM", "s", "g", "c", "0", "1-0", "IDLE", 600000, "JUSTID"],
        ["EVALSHA_RO", "abc", 0],
    ],
)
def test_reads_and_writes_that_set_are_safe_to_send_again(command: list[object]) -> None:
    assert unsafe_command([command]) is None  # type: ignore[list-item]


@pytest.mark.parametrize(
    "command",
    [
        ["INCR", "n"],
        ["HINCRBY", "h", "f", 1],
        ["RPUSH", "l", "x"],
        ["XADD", "s", "*", "f", "v"],
        ["XADD", "s", "1-1", "f", "v"],  # refused the second time
        ["XREADGROUP", "GROUP", "g", "c", "STREAMS", "s", ">"],  # delivers new entries
        ["XAUTOCLAIM", "s", "g", "c", 1000, "0-0"],
        ["XCLAIM", "s", "g", "c", 1000, "1-0", "JUSTID"],  # the repeat skips what it claimed
        ["XCLAIM", "s", "g", "c", 0, "1-0"],  # counts a delivery each time
        ["XGROUP", "CREATE", "s", "g", "0"],  # the repeat answers BUSYGROUP
        ["SET", "lock", "me", "NX", "PX", 1000],
        ["SET", "k", "v", "GET"],
        ["EVALSHA", "abc", 1, "k"],
        ["EVAL", "return 1", 0],
        ["PUBLISH", "c", "m"],
        ["CLIENT", "KILL", "ID", 7],
        ["XINFO"],
        ["NOPE"],
    ],
)
def test_deltas_deliveries_scripts_and_unknown_commands_are_not(command: list[object]) -> None:
    assert unsafe_command([command]) == str(command[0]).upper()  # type: ignore[list-item]


def test_a_pipeline_or_transaction_is_as_safe_as_its_least_safe_command() -> None:
    block = [["MULTI"], ["XACK", "s", "g", "1-0"], ["XDEL", "s", "1-0"], ["EXEC"]]
    assert unsafe_command(block) is None
    assert unsafe_command([*block[:3], ["XADD", "r", "*", "f", "v"], ["EXEC"]]) == "XADD"
    assert unsafe_command([["GET", "k"], ["INCR", "n"], ["RPUSH", "l", 1]]) == "INCR"
    assert unsafe_command([]) is None
