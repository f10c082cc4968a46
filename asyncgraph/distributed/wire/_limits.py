"""The size limits of every message received: what a worker's options and a client's
``limits=`` set, apart from the codec, so that reading them (``asyncgraph worker --help``,
a worker's configuration) loads no msgpack."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LIMITS", "Limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits applied to every message received (and checked when sending).

    Example::

        config = WorkerConfig(
            redis_url="redis://127.0.0.1:6379/0", limits=Limits(max_message_bytes=32 * 2**20)
        )
        print(Limits().max_message_bytes)    # 8388608, the default
    """

    max_message_bytes: int = 8 * 1024 * 1024
    max_str_len: int = 4 * 1024 * 1024
    max_container_len: int = 1_000_000
    max_depth: int = 64
    # Arrays and maps in one message, all levels: what bounds the memory a message decodes
    # into (an empty array is 1 byte on the wire but dozens in Python).
    max_containers: int = 100_000

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes",
            "max_str_len",
            "max_container_len",
            "max_depth",
            "max_containers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
"""The limits a worker applies unless told others (``--max-message-bytes``).

Example::

    print(DEFAULT_LIMITS.max_message_bytes, DEFAULT_LIMITS.max_depth)   # 8388608 64
"""
