"""The SSE transport's connection pool shards (transport/shards.py, issue 36): the total
bound is ``max_connections``, no shard is asked for more than its own bound while another
has room, a light load stays on one shard (its kept-alive connections are reused), and
every shard made is closed with the transport."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from recoverable.transport.shards import ClientShards


def test_the_shards_hold_max_connections_and_none_is_asked_past_its_bound() -> None:
    shards = ClientShards(max_connections=40, connect_timeout=5.0, shard_connections=16)
    assert shards.shards == 3
    assert len(shards.opened) == 1  # the others are made on first use
    counts: dict[int, int] = {}
    with ExitStack() as stack:
        clients = [stack.enter_context(shards.client()) for _ in range(40)]
        for client in clients:
            counts[id(client)] = counts.get(id(client), 0) + 1
        assert sorted(counts.values()) == [8, 16, 16]  # each shard exactly at its bound
        assert len(shards.opened) == 3
    # Every request ended: all the room is back, a new one goes to the first shard.
    with shards.client() as again:
        assert again is shards.opened[0]


def test_a_light_load_stays_on_one_shard() -> None:
    shards = ClientShards(max_connections=2048, connect_timeout=5.0)
    used = set()
    for _ in range(50):
        with shards.client() as client:
            used.add(id(client))
    assert len(used) == 1 and len(shards.opened) == 1


def test_requests_in_flight_spread_to_the_shard_with_the_most_room() -> None:
    shards = ClientShards(max_connections=64, connect_timeout=5.0, shard_connections=16)
    with shards.client() as first, shards.client() as second:
        assert first is not second  # the second shard had more room than the first
    with shards.client() as third:
        assert third is first


async def test_closing_closes_every_shard_made_and_a_new_request_reopens_one() -> None:
    shards = ClientShards(max_connections=32, connect_timeout=5.0, shard_connections=16)
    with shards.client(), shards.client():
        pass
    opened: list[httpx.AsyncClient] = shards.opened
    assert len(opened) == 2
    await shards.aclose()
    assert all(client.is_closed for client in opened)
    assert shards.opened == []
    # A backend outlives the runtime it served: the next request makes a new shard.
    with shards.client() as reopened:
        assert not reopened.is_closed and reopened not in opened
    await shards.aclose()
    assert reopened.is_closed


def test_bounds_are_positive() -> None:
    with pytest.raises(ValueError):
        ClientShards(max_connections=0, connect_timeout=5.0)
