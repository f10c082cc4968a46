"""Without hiredis (it comes with the ``fleet`` extra, not with ``pip install asyncgraph``)
the RESP client parses and packs in pure Python, against the real Redis of the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter where ``import hiredis`` fails as it does where hiredis is not
# installed: the client's choice is made once, at import.
SCRIPT = """
import sys

sys.modules["hiredis"] = None  # makes `import hiredis` raise ImportError

import anyio

from asyncgraph.resp import Pool, ReplyError, parse_redis_url
from asyncgraph.resp._hiredis_protocol import _HAVE_HIREDIS, new_reader

url, backend = sys.argv[1:]
assert not _HAVE_HIREDIS and type(new_reader()).__name__ == "Reader"


async def main() -> None:
    pool = Pool(parse_redis_url(url), timeout_s=5)
    try:
        big = b"\\x00\\r\\n" * 200_000
        assert await pool.execute("SET", "nohiredis:k", big) == b"OK"
        assert await pool.execute("GET", "nohiredis:k") == big
        replies = await pool.pipeline(
            [
                ["XADD", "nohiredis:s", "1-1", "m", b"one", "flag", True],
                ["XRANGE", "nohiredis:s", "-", "+"],
                ["NOPE"],
                ["GET", "nohiredis:missing"],
            ]
        )
        assert replies[0] == b"1-1", replies
        assert replies[1] == [[b"1-1", [b"m", b"one", b"flag", b"1"]]], replies
        assert isinstance(replies[2], ReplyError) and replies[2].code == "ERR", replies
        assert replies[3] is None
    finally:
        await pool.aclose()


anyio.run(main, backend=backend)
print("pure-python parser: ok")
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_without_hiredis_the_client_uses_its_python_parser_against_a_real_redis(
    redis_url: str, backend: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, redis_url, backend],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "pure-python parser: ok\n"
