"""The dashboard's web app: Starlette routes over one store and one runtime.

- ``GET /``: the overview (live: its page polls ``/api/overview``);
- ``GET /operations?state=&cursor=&limit=``: the list, a page at a time;
- ``GET /operations/{id}``: one operation; ``POST /operations/{id}/{action}``: an action
  (a form with the session's CSRF token), then a redirect back to the operation, whose
  next page shows the result once (kept in the session, never in the URL);
- ``GET /api/overview?since=VERSION``: the overview's live region, rendered from the
  current summary, with its version (``{"version": N}`` alone while it is still
  ``since``): the page polls it every 2 s, no connection is held between two polls;
- ``GET /api/summary`` and ``GET /api/operations``: the same data as JSON.

Bad input is a 400 with a typed code (``invalid_request``), an unknown operation a 404
(``state_unavailable``), a refused action a 403 or 409 with its code. Access control is
``dashboard.security.Guard`` around this app.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any, Final
from urllib.parse import parse_qsl, quote

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Route

from recoverable import errors
from recoverable.actors.runtime import Runtime
from recoverable.cli.bulk import (
    BULK_ACTIONS,
    BulkAction,
    BulkOptions,
    BulkResult,
    Ledger,
    act_on_many,
)
from recoverable.cli.bulk import preview as bulk_preview
from recoverable.cli.selection import (
    FILTER_KEYS,
    SelectionCache,
    page_of,
    parse_filter,
    parse_filter_text,
    parse_sort,
)
from recoverable.dashboard import console as console
from recoverable.dashboard import pages as pages
from recoverable.dashboard.actions import (
    ActionRefused,
    binding_refusal_text,
    buttons,
    new_action_id,
    perform,
)
from recoverable.dashboard.data import (
    DEFAULT_PAGE,
    DashboardStore,
    Summary,
    build_summary,
    operation_view,
)
from recoverable.preconditions import MAX_ATTEMPTS
from recoverable.pricing import PriceTable
from recoverable.telemetry import TelemetrySink

__all__ = ["Dashboard"]

MAX_FORM_BYTES: Final = 4096
MAX_BULK_FORM_BYTES: Final = 64 * 1024  # a preview form names up to a page of ticked ids
MAX_PENDING: Final = 64  # previews awaiting their confirmation
MIN_REFRESH: Final = 1.0  # seconds between two summaries, at least
IDLE_REFRESH: Final = 15.0  # rebuild even without a commit (the charts' minutes move)
_STATUS_OF: Final = {
    "invalid_request": 400,
    "state_unavailable": 404,
    "account_required": 403,
    "account_changed": 403,
    "csrf_refused": 403,
}


def _csp(nonce: str) -> str:
    return (f"default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; "
            "frame-ancestors 'none'")


class Dashboard:
    """The app's state: the store, the runtime that acts, the current summary."""

    def __init__(
        self,
        store: DashboardStore,
        runtime: Runtime,
        *,
        sessions_csrf: Callable[[str], str],
        check_csrf: Callable[[str | None, str | None], bool],
        flash: Callable[[str, str, str, str], None],
        take_flash: Callable[[str, str], tuple[str, str] | None],
        context: str,
        show_content: bool,
        telemetry: TelemetrySink,
        prices: PriceTable | None = None,
    ) -> None:
        self.store = store
        self.runtime = runtime
        self.csrf_of = sessions_csrf
        self.check_csrf = check_csrf
        self.flash = flash
        self.take_flash = take_flash
        self.context = context
        self.show_content = show_content
        self.telemetry = telemetry
        self.prices = prices
        self.summary: Summary | None = None
        self.failure: errors.RecoveryError | None = None  # the store's, at the last read
        self.version = 0
        self._rendered: tuple[int, str] = (-1, "")  # the live region of ``version``
        self._poke = trio.Event()
        self._ready = trio.Event()
        self.selections = SelectionCache()
        self.ledger = Ledger()
        # action id -> the preview awaiting its one confirmation: (session, action,
        # options, the operation ids frozen at the preview, the selection's description)
        self.pending: OrderedDict[
            str, tuple[str, BulkAction, BulkOptions, tuple[str, ...], str]] = OrderedDict()

    # -- the summary ------------------------------------------------------------------

    async def refresh_forever(self) -> None:
        """Rebuild the summary when the store changed: at most every ``max(MIN_REFRESH,
        3 x the last build time)``, when a value it shows ends by time alone
        (``Summary.changes_at``: a cooldown, a shared pause, a lease), and every
        ``IDLE_REFRESH`` seconds anyway. A store that cannot be read is reported
        (``failure``: every page answers 503 with its code) and tried again at the next
        round; the dashboard stays up."""
        while True:
            try:
                await self._refresh()
                self.failure = None
            except errors.RecoveryError as exc:
                self.failure = exc
                self._ready.set()  # waiting requests get the failure now
            summary = self.summary
            pause = max(MIN_REFRESH, 3 * summary.build_seconds if summary else 0.0)
            with trio.move_on_after(pause):
                await self._poke.wait()
            self._poke = trio.Event()

    async def _refresh(self) -> None:
        summary = self.summary
        now = time.time()
        if (summary is None or self.failure is not None
                or now - summary.built_at >= IDLE_REFRESH
                or (summary.changes_at is not None and now >= summary.changes_at)
                or self.store.last_txnid() != summary.txnid):
            self.summary = await trio.to_thread.run_sync(
                partial(build_summary, self.store, prices=self.prices, previous=summary))
            self.version += 1
            self._ready.set()

    async def current(self) -> Summary:
        """The current summary; the store's typed failure while it cannot be read."""
        await self._ready.wait()
        if self.failure is not None:
            raise self.failure
        assert self.summary is not None
        return self.summary

    # -- responses --------------------------------------------------------------------

    def _html(self, render: Callable[[str], str], status: int = 200) -> HTMLResponse:
        nonce = secrets.token_urlsafe(16)
        return HTMLResponse(render(nonce), status_code=status,
                            headers={"content-security-policy": _csp(nonce)})

    def _error(self, request: Request, exc: errors.RecoveryError | ActionRefused) -> Response:
        status = 503 if isinstance(exc, errors.StorageUnavailable) else _STATUS_OF.get(
            exc.code, 409)
        message = str(exc)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": exc.code, "message": message}, status_code=status)
        return self._html(lambda nonce: pages.error_page(
            status, exc.code, message, nonce=nonce, context=self.context), status)

    # -- routes -----------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        try:
            summary = await self.current()
        except errors.RecoveryError as exc:
            return self._error(request, exc)
        version = self.version
        return self._html(lambda nonce: pages.overview_page(
            summary, version, nonce=nonce, context=self.context))

    async def overview_json(self, request: Request) -> Response:
        """The overview's live region, unless the page already has this version."""
        try:
            summary = await self.current()
        except errors.RecoveryError as exc:
            return self._error(request, exc)
        version = self.version
        if request.query_params.get("since") == str(version):
            return JSONResponse({"version": version})
        if self._rendered[0] != version:  # rendered once per summary, for every page
            self._rendered = (version, pages.overview_live(summary))
        return JSONResponse({"version": version, "built_at": summary.built_at,
                             "counts": summary.counts(), "html": self._rendered[1]})

    async def operations(self, request: Request) -> Response:
        try:
            summary = await self.current()
            params = _list_params(request)
            chosen = parse_filter(params)
            sort, descending = parse_sort(params)
            selected = self.selections.get(summary, chosen, sort, descending)
            page = page_of(selected, chosen, sort=sort, descending=descending,
                           cursor=params.get("cursor"), limit=_limit(params))
        except errors.RecoveryError as exc:
            return self._error(request, exc)
        if request.url.path.startswith("/api/"):
            return JSONResponse({
                "operations": [
                    {"operation_id": row.operation_id, "job_id": row.job_id,
                     "state": row.state, "availability": row.availability,
                     "attempts_used": row.attempts_used,
                     "maximum_attempts": row.maximum_attempts, "failure": row.failure,
                     "failure_code": row.failure_code, "model": row.model,
                     "owner": row.owner, "orphaned": row.orphaned,
                     "created_at": row.created_at,
                     "updated_at": row.updated_at} for row in page.rows
                ],
                "next_cursor": page.next_cursor, "matching": page.matching,
                "state": page.state, "limit": page.limit, "filter": page.filter.params(),
                "sort": page.sort, "order": "desc" if page.descending else "asc",
            })
        csrf = self.csrf_of(request.scope["state"]["session"])
        return self._html(lambda nonce: console.operations_page(
            page, csrf=csrf, can_act=binding_refusal_text(self.runtime), nonce=nonce,
            context=self.context))

    # -- bulk actions -----------------------------------------------------------------

    async def bulk_preview(self, request: Request) -> Response:
        """A preview of a bulk action (nothing done): the selection is frozen under a
        fresh action id, which the one confirmation names."""
        session = request.scope["state"]["session"]
        try:
            pairs = await _form_pairs(request, MAX_BULK_FORM_BYTES, 1000)
            form = dict(pairs)
            self._check_form(session, form)
            action, options = _bulk_choice(form)
            if form.get("target") == "filter":
                chosen = parse_filter_text(form.get("filter", ""))
                sort, descending = parse_sort(form)
                summary = await self.current()
                ids = tuple(row.operation_id for row in self.selections.get(
                    summary, chosen, sort, descending).rows)
                described = f"filter {chosen.describe()}"
            else:
                ids = tuple(dict.fromkeys(value for key, value in pairs if key == "ids"))
                if not ids:
                    raise errors.InvalidRequest(
                        "no operation ticked: tick some, or choose every operation "
                        "matching the filter")
                described = f"{len(ids)} ticked operation(s)"
            preview = await trio.to_thread.run_sync(partial(
                bulk_preview, self.runtime, self.store, ids, action, options))
        except (errors.RecoveryError, ActionRefused) as exc:
            return self._error(request, exc)
        action_id = new_action_id()
        self.pending[action_id] = (session, action, options, ids, described)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        csrf = self.csrf_of(session)
        return self._html(lambda nonce: console.bulk_preview_page(
            preview, options, action_id=action_id, described=described, csrf=csrf,
            nonce=nonce, context=self.context))

    async def bulk_confirm(self, request: Request) -> Response:
        """The one confirmation: act on the preview's operations, once per action id (a
        repeated confirmation does nothing and shows the first result)."""
        session = request.scope["state"]["session"]
        try:
            form = await _form(request)
            self._check_form(session, form)
            action_id = form.get("action_id", "")
            done = self.ledger.get(action_id)
            if done is None:
                pending = self.pending.get(action_id)
                if pending is None or pending[0] != session:
                    raise ActionRefused("no such preview in this session: preview the "
                                        "action again", code="state_unavailable")
                _, action, options, ids, _ = pending
                result = await act_on_many(
                    self.runtime, self.store, ids, action, options,
                    action_id=action_id, telemetry=self.telemetry, ledger=self.ledger)
                self.pending.pop(action_id, None)
                self._poke.set()
            else:
                result = done
                self.flash(session, f"bulk:{action_id}", "done",
                           "this action id was done already: nothing was done again")
        except (errors.RecoveryError, ActionRefused) as exc:
            return self._error(request, exc)
        return RedirectResponse(f"/bulk/{quote(result.action_id, safe='')}", status_code=303)

    async def bulk_result(self, request: Request) -> Response:
        action_id = request.path_params["action_id"]
        found: BulkResult | None = self.ledger.get(action_id)
        if found is None:
            return self._error(request, errors.StateUnavailable("no such bulk action"))
        result = found
        session = request.scope["state"]["session"]
        _kind, text = self.take_flash(session, f"bulk:{action_id}") or ("", "")
        return self._html(lambda nonce: console.bulk_result_page(
            result, note=text or None, nonce=nonce, context=self.context))

    def _check_form(self, session: str, form: dict[str, str]) -> None:
        if not self.check_csrf(session, form.get("csrf")):
            raise ActionRefused("the form is stale or not from this dashboard: reload the "
                                "page", code="csrf_refused")
        refusal = binding_refusal_text(self.runtime)
        if refusal is not None:
            raise ActionRefused(refusal, code="account_required")

    async def summary_json(self, request: Request) -> Response:
        try:
            return JSONResponse((await self.current()).counts())
        except errors.RecoveryError as exc:
            return self._error(request, exc)

    async def operation(self, request: Request) -> Response:
        operation_id = request.path_params["operation_id"]
        try:
            view = operation_view(self.store, operation_id, viewer=self.runtime.account,
                                  show_content=self.show_content)
        except errors.RecoveryError as exc:
            return self._error(request, exc)
        session = request.scope["state"]["session"]
        csrf = self.csrf_of(session)
        # The banner comes from the session only: a "?done=" in a link shows nothing.
        kind, text = self.take_flash(session, operation_id) or ("", "")
        return self._html(lambda nonce: pages.operation_page(
            view, buttons(self.runtime, view), csrf=csrf, nonce=nonce, context=self.context,
            flash=text if kind == "done" else None, error=text if kind == "error" else None))

    async def act(self, request: Request) -> Response:
        operation_id = request.path_params["operation_id"]
        action = request.path_params["action"]
        session = request.scope["state"]["session"]
        try:
            form = await _form(request)
            if not self.check_csrf(session, form.get("csrf")):
                raise ActionRefused("the form is stale or not from this dashboard: reload "
                                    "the page", code="csrf_refused", operation_id=operation_id)
            view = operation_view(self.store, operation_id, viewer=self.runtime.account,
                                  show_content=False)
            message = await perform(self.runtime, view, action, form,
                                    telemetry=self.telemetry)
        except (errors.RecoveryError, ActionRefused) as exc:
            if exc.code in ("csrf_refused", "invalid_request", "state_unavailable"):
                return self._error(request, exc)
            self.flash(session, operation_id, "error", f"{action}: {exc.code}: {exc}")
        else:
            self._poke.set()
            self.flash(session, operation_id, "done", message)
        return RedirectResponse(f"/operations/{quote(operation_id, safe='')}",
                                status_code=303)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/", self.overview, methods=["GET"]),
            Route("/operations", self.operations, methods=["GET"]),
            Route("/api/operations", self.operations, methods=["GET"]),
            Route("/api/summary", self.summary_json, methods=["GET"]),
            Route("/api/overview", self.overview_json, methods=["GET"]),
            Route("/operations/{operation_id}", self.operation, methods=["GET"]),
            Route("/operations/{operation_id}/{action}", self.act, methods=["POST"]),
            Route("/bulk/preview", self.bulk_preview, methods=["POST"]),
            Route("/bulk/confirm", self.bulk_confirm, methods=["POST"]),
            Route("/bulk/{action_id}", self.bulk_result, methods=["GET"]),
        ])


_LIST_KEYS: Final = frozenset({*FILTER_KEYS, "sort", "order", "cursor", "limit"})


def _list_params(request: Request) -> dict[str, str]:
    params = request.query_params
    unknown = set(params) - _LIST_KEYS
    if unknown:
        raise errors.InvalidRequest(f"unknown parameter(s): {', '.join(sorted(unknown))[:100]}")
    return dict(params)


def _limit(params: dict[str, str]) -> int:
    text = params.get("limit", str(DEFAULT_PAGE))
    if not text.isdigit() or len(text) > 4:
        raise errors.InvalidRequest("limit: an integer 1..200")
    return int(text)


def _bulk_choice(form: dict[str, str]) -> tuple[BulkAction, BulkOptions]:
    """The bulk action and its options, from the list's form."""
    action = next((known for known in BULK_ACTIONS if known == form.get("action")), None)
    if action is None:
        raise errors.InvalidRequest(f"action: one of {', '.join(BULK_ACTIONS)}")
    selection = form.get("selection") or "preserve"
    if selection not in ("preserve", "reselect"):
        raise errors.InvalidRequest("selection: preserve or reselect")
    budget = form.get("max_attempts", "").strip()
    if budget and (not budget.isdigit() or not 1 <= int(budget) <= MAX_ATTEMPTS):
        raise errors.InvalidRequest(f"max_attempts: an integer 1..{MAX_ATTEMPTS}")
    return action, BulkOptions(
        selection="reselect" if selection == "reselect" else "preserve",
        max_attempts=int(budget) if budget else None, force=form.get("force") == "1")


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form of at most ``MAX_FORM_BYTES`` (no multipart)."""
    return dict(await _form_pairs(request, MAX_FORM_BYTES, 20))


async def _form_pairs(request: Request, max_bytes: int, max_fields: int) -> list[tuple[str, str]]:
    """An urlencoded form's fields, in order (a name may repeat: the ticked ids)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/x-www-form-urlencoded":
        raise errors.InvalidRequest("a form (application/x-www-form-urlencoded) is expected")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise errors.InvalidRequest(f"the form is larger than {max_bytes} bytes")
    try:
        return parse_qsl(body.decode("utf-8"), keep_blank_values=True,
                         max_num_fields=max_fields, strict_parsing=bool(body))
    except (UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest("not a form of this dashboard") from None


def json_line(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True) + "\n"
