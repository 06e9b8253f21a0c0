"""A TCP relay in front of the test server that can lose a connection at a chosen moment.

It parses the client's side of the PostgreSQL protocol (one untyped startup message,
then typed messages: a type byte and an int32 length) just enough to recognise the
simple-query ``COMMIT`` psycopg sends for ``conn.commit()``. Armed once, it then:

- ``"lose_commit"``: never forwards that COMMIT and closes the connection (the server
  rolls the transaction back: the client cannot know that);
- ``"lose_commit_reply"``: forwards it, lets the server answer (the commit is durable:
  ``synchronous_commit=on``), drops the answer and closes the connection (the client
  cannot know the commit happened).

``down()`` closes every connection and refuses new ones until ``up()``. Use URLs with
``sslmode=disable&gssencmode=disable`` (no TLS negotiation to relay).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

__all__ = ["PgProxy"]

_COMMIT = b"Q" + struct.pack("!I", 4 + len(b"COMMIT\0")) + b"COMMIT\0"


def _is_commit(message: bytes) -> bool:
    """A simple-query COMMIT, or the Parse of one (psycopg's pipeline mode sends it with
    the extended protocol: 'P', length, statement name, query, parameter types)."""
    if message == _COMMIT:
        return True
    if message[:1] != b"P":
        return False
    _name, _, rest = message[5:].partition(b"\0")
    return rest.split(b"\0", 1)[0] == b"COMMIT"


class _Link:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.drop_reply = threading.Event()

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class PgProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: str | None = None
        self._down = False
        self._links: list[_Link] = []
        self.fired = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, dbname: str) -> str:
        return (
            f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"
            "?sslmode=disable&gssencmode=disable"
        )

    def arm(self, mode: str) -> None:
        assert mode in ("lose_commit", "lose_commit_reply")
        with self._lock:
            self._armed = mode
            self.fired.clear()

    def down(self) -> None:
        with self._lock:
            self._down = True
            links, self._links = self._links, []
        for link in links:
            link.close()

    def up(self) -> None:
        with self._lock:
            self._down = False

    def close(self) -> None:
        self.down()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
            threading.Thread(target=self._client_to_server, args=(link,), daemon=True).start()
            threading.Thread(target=self._server_to_client, args=(link,), daemon=True).start()

    @staticmethod
    def _read_exact(sock: socket.socket, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = sock.recv(count - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _client_to_server(self, link: _Link) -> None:
        try:
            (length,) = struct.unpack("!I", self._read_exact(link.client, 4))
            startup = self._read_exact(link.client, length - 4)  # the untyped startup message
            link.server.sendall(struct.pack("!I", length) + startup)
            while True:
                head = self._read_exact(link.client, 5)
                (length,) = struct.unpack("!I", head[1:])
                message = head + self._read_exact(link.client, length - 4)
                if _is_commit(message):
                    with self._lock:
                        mode, self._armed = self._armed, None
                    if mode == "lose_commit":
                        self.fired.set()
                        link.close()
                        return
                    if mode == "lose_commit_reply":
                        link.drop_reply.set()
                link.server.sendall(message)
        except OSError:
            link.close()

    def _server_to_client(self, link: _Link) -> None:
        try:
            while True:
                data = link.server.recv(65536)
                if not data:
                    raise OSError("closed")
                if link.drop_reply.is_set():
                    # The server's answer to the COMMIT (CommandComplete, ReadyForQuery):
                    # the commit is durable; the client never hears of it.
                    self.fired.set()
                    link.close()
                    return
                link.client.sendall(data)
        except OSError:
            link.close()
