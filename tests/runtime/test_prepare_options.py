"""``PrepareOptions`` carries ``prepare``'s and ``submit``'s options as one value: its
defaults are ``prepare``'s, and its ``checked`` is the one place they are validated,
giving the typed errors (and their order) the keyword arguments always gave."""

from __future__ import annotations

import inspect

import attrs
import pytest

import recoverable
from recoverable import errors
from recoverable.actors.options import PrepareOptions
from recoverable.preconditions import MAX_ATTEMPTS
from recoverable.testing import FixtureProvider

from .conftest import ACCOUNT, REQUEST, Answer, make_backend

BAD_ATTEMPTS = f"maximum_attempts must be an integer in 1..{MAX_ATTEMPTS}"


def test_the_options_default_as_prepare_does() -> None:
    signature = inspect.signature(recoverable.Runtime.prepare)
    fields = {field.name: field for field in attrs.fields(PrepareOptions)}
    keywords = {
        name: parameter for name, parameter in signature.parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "response"
    }
    # Every keyword of prepare is an option (submit adds only unclaimed_after).
    assert set(fields) == set(keywords) | {"unclaimed_after"}
    for name, parameter in keywords.items():
        assert fields[name].default is (
            attrs.NOTHING if parameter.default is inspect.Parameter.empty else parameter.default
        ) or fields[name].default == parameter.default, name


@pytest.mark.parametrize("attempts", [0, -1, MAX_ATTEMPTS + 1, True, "3", 2.0])
async def test_a_bad_budget_is_the_same_invalid_request_everywhere(
    provider: FixtureProvider, store: recoverable.RecoveryStore, attempts: object
) -> None:
    backend = make_backend(provider)
    with pytest.raises(errors.InvalidRequest, match=f"^{BAD_ATTEMPTS}(;|$)"):
        PrepareOptions(maximum_attempts=attempts).checked(  # type: ignore[arg-type]
            lease_seconds=30.0, backend=backend
        )
    async with recoverable.open_runtime(store, backend, account=ACCOUNT) as rt:
        before = store.stats()["entries"]
        with pytest.raises(errors.InvalidRequest, match=f"^{BAD_ATTEMPTS}(;|$)"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=attempts)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidRequest, match=f"^{BAD_ATTEMPTS}(;|$)"):
            await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=attempts)  # type: ignore[arg-type]
        assert store.stats()["entries"] == before


async def test_other_bad_options_keep_their_typed_errors(
    provider: FixtureProvider, store: recoverable.RecoveryStore
) -> None:
    async with recoverable.open_runtime(store, make_backend(provider), account=ACCOUNT) as rt:
        with pytest.raises(errors.InvalidParameter) as caught:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             expires_at="tomorrow")
        assert caught.value.parameter == "expires_at"
        with pytest.raises(errors.InvalidRequest, match="on_interruption"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             on_interruption="retry")  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidParameter) as caught:
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1,
                             live=True, reattach=True)
        assert caught.value.parameter == "reattach"
        with pytest.raises(errors.InvalidRequest, match="unclaimed_after"):
            await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=1,
                            unclaimed_after=-1)
        with pytest.raises(TypeError):
            await rt.submit(REQUEST, response=Answer, job_id="j", maximum_attempts=1,
                            colour=1)


async def test_checks_come_in_their_old_order(store: recoverable.RecoveryStore) -> None:
    # The options are checked before the backend is looked for; a signed-out runtime
    # refuses before any option is looked at.
    async with recoverable.open_runtime(store, None, account=ACCOUNT) as rt:
        with pytest.raises(errors.InvalidRequest, match=f"^{BAD_ATTEMPTS}(;|$)"):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=0)
        with pytest.raises(errors.ConfigurationUnavailable):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=1)
        rt.sign_out()
        with pytest.raises(errors.AccountChanged):
            await rt.prepare(REQUEST, response=Answer, maximum_attempts=0)
