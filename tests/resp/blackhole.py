"""A TCP proxy that can silently black-hole its established connections (a lost NAT entry),
lose the reply to a request (the connection drops after Redis ran the command), stall
(forward nothing either way for a while, then everything held back: a congested link), or
hand replies on in small pieces (a slow link, or a reply that takes long to read)."""

from __future__ import annotations

import select
import socket
import threading
import time


class BlackholeProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``blackhole()`` makes every connection open at
    that moment swallow all data both ways (no RST, no FIN), while new ones work.
    ``drop_next_reply(after=b"XADD")``: the reply to the next request that contains
    ``after`` (any request by default) is thrown away and its connection closed both ways:
    Redis ran the command, the client lost its reply. ``pause()`` stalls every connection,
    open or new (nothing is read from either side, so nothing is lost) until ``resume()``.
    ``throttle(piece, every_s)``: what Redis sends goes on ``piece`` bytes at a time, with
    a pause of ``every_s`` after each piece. ``accepted`` counts the connections made through the proxy."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._generation = 0
        self._drops: list[bytes] = []
        self._lock = threading.Lock()
        self.accepted = 0
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._throttle: tuple[int, float] | None = None
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def blackhole(self) -> None:
        self._generation += 1

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def throttle(self, piece: int, every_s: float) -> None:
        self._throttle = (piece, every_s)

    def drop_next_reply(self, after: bytes = b"") -> None:
        with self._lock:
            self._drops.append(after)

    def _arm(self, request: bytes) -> bool:
        """Whether the reply to ``request`` is to be dropped (claiming that drop)."""
        with self._lock:
            for i, marker in enumerate(self._drops):
                if marker in request:
                    del self._drops[i]
                    return True
            return False

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self.target)
            self.accepted += 1
            thread = threading.Thread(
                target=self._pipe, args=(client, upstream, self._generation), daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _pipe(self, a: socket.socket, b: socket.socket, generation: int) -> None:
        peers = {a: b, b: a}
        armed = False  # the reply on its way is to be dropped
        try:
            while not self._stop.is_set():
                if self._paused.is_set():
                    time.sleep(0.01)
                    continue
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is a and not armed:
                        armed = self._arm(data)
                    elif sock is b and armed:
                        return  # closes both: the client sees its connection lost
                    if self._generation != generation:
                        continue  # swallowed, silently
                    if sock is b and self._throttle is not None:
                        piece, every_s = self._throttle
                        for i in range(0, len(data), piece):
                            a.sendall(data[i : i + piece])
                            time.sleep(every_s)
                    else:
                        peers[sock].sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for thread in self._threads:
            thread.join(2)
