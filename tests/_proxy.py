"""A TCP proxy in front of a test server that loses a reply on purpose.

Clients connect to :attr:`ReplyDropper.port`; every byte goes on to the
server and back, until :meth:`ReplyDropper.drop_reply_to` arms it with a
marker: the next request carrying the marker still reaches the server (so
the operation is applied), but its reply is swallowed and the client's
connection closed -- the "lost answer" after which redis-py, pymongo and
ratequeue's own retries send the operation again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class ReplyDropper:
    """Forwards loopback connections to ``127.0.0.1:target_port``; drops one reply when armed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._marker: bytes | None = None
        #: set once a reply has been dropped
        self.dropped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="reply-dropper").start()

    def drop_reply_to(self, marker: bytes) -> None:
        """Lose the reply to the next request whose bytes contain ``marker``."""
        with self._lock:
            self._marker = marker
            self.dropped.clear()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _close(sock)

    def __enter__(self) -> ReplyDropper:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            # one flag per connection: set when a marked request went out, cleared by dropping its reply
            armed = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, armed), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, armed), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, armed: threading.Event) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            with self._lock:
                if self._marker is not None and self._marker in data:
                    self._marker = None
                    armed.set()
            try:
                server.sendall(data)
            except OSError:
                break
        _close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, armed: threading.Event) -> None:
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if armed.is_set():  # the marked request's answer: lose it, and the connection with it
                self.dropped.set()
                break
            try:
                client.sendall(data)
            except OSError:
                break
        _close(client, server)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
