"""Issue 10.9: the endpoint identity saved with an operation, and base URLs refused at
construction (never after an attempt was spent)."""

from __future__ import annotations

import msgspec
import pytest

import recoverable
from recoverable.storage import codec
from recoverable.storage.keys import operation_key
from recoverable.storage.store import WriteTxn
from recoverable.testing import FixtureProvider, Reply
from recoverable.transport.backend import check_base_url, endpoint_identity

from .conftest import ACCOUNT, REQUEST, Answer, Authorizer, generation_requests


def backend(url: str, label: str | None = None) -> recoverable.ResponsesBackend:
    return recoverable.ResponsesBackend(
        url, credentials=recoverable.StaticCredentials("k", account=ACCOUNT), mode="sse",
        endpoint_id=label,
    )


async def test_a_websocket_url_is_refused_at_construction_in_both_modes(
    provider: FixtureProvider,
) -> None:
    for mode in ("websocket", "sse"):
        with pytest.raises(recoverable.InvalidRequest, match="HTTP"):
            recoverable.ResponsesBackend(
                provider.websocket_url,
                credentials=recoverable.StaticCredentials("k", account=ACCOUNT),
                mode=mode,  # type: ignore[arg-type]
            )
    with pytest.raises(recoverable.InvalidRequest, match="HTTP"):
        backend("wss://api.example.com/v1")
    with pytest.raises(recoverable.InvalidRequest, match="/responses"):
        backend(provider.http_url + "/responses")
    assert check_base_url("HTTPS://API.example.com:443/v1/") == "https://api.example.com/v1"


def test_endpoint_identity_defaults_to_the_url_and_binds_a_label_to_the_host() -> None:
    assert backend("http://127.0.0.1:8000/v1/").endpoint_id == "http://127.0.0.1:8000/v1"
    assert backend("http://127.0.0.1:8000/v1", "svc").endpoint_id == "svc@127.0.0.1"
    # The port (and path) may change under a label; the host may not.
    assert backend("http://127.0.0.1:9/other", "svc").endpoint_id == "svc@127.0.0.1"
    assert backend("http://LOCALHOST:9/v1", "svc").endpoint_id == "svc@localhost"
    assert endpoint_identity("http://[::1]:80/v1", "svc") == "svc@::1"
    for bad in ("", "a@b", "http://x", "x" * 257, "n\0l"):
        with pytest.raises(recoverable.InvalidRequest, match="endpoint_id"):
            backend("http://127.0.0.1/v1", bad)


async def test_a_custom_label_on_another_host_is_a_configuration_block(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    port = provider.http_url.split(":")[2].split("/")[0]
    here = backend(provider.http_url, "svc")
    async with recoverable.open_runtime(store, here, account=ACCOUNT) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=2)
    # Same label, same port, another host name: blocked before any callback or POST.
    elsewhere = backend(f"http://localhost:{port}/v1", "svc")
    async with recoverable.open_runtime(store, elsewhere, account=ACCOUNT) as rt:
        status = await rt.status(handle)
        assert status.blockers == frozenset({"configuration_unavailable"})
        assert status.availability == "blocked"
        auth = Authorizer()
        with pytest.raises(recoverable.ConfigurationUnavailable):
            await rt.send_recovering(handle, response=Answer, authorize=auth)
        assert auth.calls == []
    # Same label and host, another port: the same endpoint (it runs).
    moved = backend("http://127.0.0.1:9/v1", "svc")
    async with recoverable.open_runtime(store, moved, account=ACCOUNT) as rt:
        assert (await rt.status(handle)).blockers == frozenset()
    provider.script([Reply.complete({"answer": 1, "note": "here"})])
    async with recoverable.open_runtime(store, here, account=ACCOUNT) as rt:
        assert await rt.send_recovering(handle, response=Answer, authorize=Authorizer()) == (
            Answer(1, "here")
        )
    assert len(generation_requests(provider, handle.operation_id)) == 1


async def test_a_bare_label_saved_before_host_binding_still_matches_its_label(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    """Records saved with a bare label (before labels were bound to the host) keep
    running under the same label, so an existing store is not blocked by the change."""
    async with recoverable.open_runtime(
        store, backend(provider.http_url, "svc"), account=ACCOUNT
    ) as rt:
        handle = await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)

    def legacy(txn: WriteTxn) -> None:
        record = txn.get_operation(handle.operation_id)
        assert record is not None and record.endpoint_id == "svc@127.0.0.1"
        # Forged as older code wrote it: raw bytes (put_operation refuses to change an
        # admission field, issue 14.2; the endpoint is not in the hosts index).
        old = msgspec.structs.replace(record, endpoint_id="svc")
        txn.put_raw("operations", operation_key(old.operation_id), codec.encode(old))

    store.write_sync(legacy)
    async with recoverable.open_runtime(
        store, backend(provider.http_url, "other"), account=ACCOUNT
    ) as rt:
        assert (await rt.status(handle)).blockers == frozenset({"configuration_unavailable"})
    async with recoverable.open_runtime(
        store, backend(provider.http_url, "svc"), account=ACCOUNT
    ) as rt:
        assert (await rt.status(handle)).blockers == frozenset()
        assert isinstance(
            await rt.send_recovering(handle, response=Answer, authorize=Authorizer()), Answer
        )
