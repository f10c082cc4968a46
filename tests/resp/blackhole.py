"""A TCP proxy that can silently black-hole its established connections (a lost NAT entry),
or lose the reply to a request (the connection drops after Redis ran the command)."""

from __future__ import annotations

import select
import socket
import threading


class BlackholeProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``blackhole()`` makes every connection open at
    that moment swallow all data both ways (no RST, no FIN), while new ones work.
    ``drop_next_reply()``: the next bytes Redis sends back on any connection are thrown
    away and that connection is closed both ways (the command ran; its reply is lost).
    ``accepted`` counts the connections made through the proxy."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._generation = 0
        self._drops = 0
        self._lock = threading.Lock()
        self.accepted = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def blackhole(self) -> None:
        self._generation += 1

    def drop_next_reply(self) -> None:
        with self._lock:
            self._drops += 1

    def _drop(self) -> bool:
        with self._lock:
            if not self._drops:
                return False
            self._drops -= 1
            return True

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
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is b and self._drop():
                        return  # closes both: the client sees its connection lost
                    if self._generation == generation:  # else: swallowed, silently
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
