"""The SSE transport's HTTP clients: many small connection pools instead of one large one.

httpcore's connection pool (httpx's) re-examines every one of its connections whenever a
request starts or a response is closed: each idle connection is asked whether it expired
(a readability probe of its socket: a system call) and, with httpcore 1.0, whether it is
one idle connection too many (a list built over the whole pool: quadratic). With
thousands of parked operations each keeping a connection alive, that examination was the
event loop's whole time: measured with ``bench/scheduler_lateness.py`` over SSE, 300
parked operations woke with a p99 lateness of 9.6 s, and at a few thousand the heartbeat's
renewals were starved past the leases' margins (``LeaseLost``).

:class:`ClientShards` keeps the same total bound (``max_connections``) over shards of at
most :data:`SHARD_CONNECTIONS` connections each, made on first use and sharing one TLS
context (building one loads the CA bundle: milliseconds). A request goes to the shard with
the most room left (the lowest index among equals, so a light load stays on one shard
and reuses its kept-alive connections). Since the backend admits at most
``max_connections`` requests at once, the shard with the most room has room whenever the
total has: a request never waits in a shard's queue while another shard has room.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import httpx

__all__ = ["SHARD_CONNECTIONS", "ClientShards"]

SHARD_CONNECTIONS: Final = 16


class ClientShards:
    """``max_connections`` HTTP connections over shards of small httpx clients."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        shard_connections: int = SHARD_CONNECTIONS,
    ) -> None:
        if max_connections < 1 or shard_connections < 1:
            raise ValueError("max_connections and shard_connections must be positive")
        count = math.ceil(max_connections / shard_connections)
        # The last shard holds what is left over, so the total bound is max_connections.
        self._sizes = [shard_connections] * (count - 1) + [
            max_connections - shard_connections * (count - 1)
        ]
        self._clients: list[httpx.AsyncClient | None] = [None] * count
        self._room = list(self._sizes)  # connections each shard may still open or lend
        self._connect_timeout = connect_timeout
        self._tls: ssl.SSLContext | None = None
        # Requests are built (never sent) on one client: building touches no pool, and
        # builds on after the client is closed.
        self.builder = self._client(0)

    @property
    def shards(self) -> int:
        return len(self._clients)

    @property
    def opened(self) -> list[httpx.AsyncClient]:
        """The shards made so far (tests: each is closed with the transport)."""
        return [client for client in self._clients if client is not None]

    def _client(self, index: int) -> httpx.AsyncClient:
        client = self._clients[index]
        if client is not None:
            return client
        if self._tls is None:
            self._tls = httpx.create_ssl_context(trust_env=False)
        size = self._sizes[index]
        client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=size, max_keepalive_connections=size, keepalive_expiry=30.0,
            ),
            # Connect is bounded here; idle time is bounded per event by the caller's scope.
            timeout=httpx.Timeout(
                connect=self._connect_timeout, read=None, write=None, pool=None
            ),
            verify=self._tls,
            follow_redirects=False,
            trust_env=False,
        )
        self._clients[index] = client
        return client

    @contextmanager
    def client(self) -> Iterator[httpx.AsyncClient]:
        """The client of the shard with the most room, counted as one more request in
        flight until the block ends (the response must be closed inside it). After
        :meth:`aclose`, the shards are made again on first use: a backend outlives the
        runtime (and the ``async with``) it served."""
        room = self._room
        index = room.index(max(room))
        client = self._client(index)
        room[index] -= 1
        try:
            yield client
        finally:
            room[index] += 1

    async def aclose(self) -> None:
        """Close the shards made so far; a later request makes new ones (a request still
        running on a closed shard ends on its own)."""
        opened = self.opened
        self._clients = [None] * len(self._clients)
        for client in opened:
            await client.aclose()
