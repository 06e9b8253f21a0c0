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
``dashboard_security.Guard`` around this app.
"""

from __future__ import annotations

import json
import secrets
import time
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
from recoverable.cli import dashboard_pages as pages
from recoverable.cli.dashboard_actions import ActionRefused, buttons, perform
from recoverable.cli.dashboard_data import (
    DEFAULT_PAGE,
    DashboardStore,
    Summary,
    build_summary,
    operation_view,
    page_of,
)
from recoverable.pricing import PriceTable
from recoverable.telemetry import TelemetrySink

__all__ = ["Dashboard"]

MAX_FORM_BYTES: Final = 4096
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
            page = page_of(await self.current(), **_page_arguments(request))
        except errors.RecoveryError as exc:
            return self._error(request, exc)
        if request.url.path.startswith("/api/"):
            return JSONResponse({
                "operations": [
                    {"operation_id": row.operation_id, "job_id": row.job_id,
                     "state": row.state, "availability": row.availability,
                     "attempts_used": row.attempts_used,
                     "maximum_attempts": row.maximum_attempts, "failure": row.failure,
                     "created_at": row.created_at} for row in page.rows
                ],
                "next_cursor": page.next_cursor, "matching": page.matching,
                "state": page.state, "limit": page.limit,
            })
        return self._html(lambda nonce: pages.operations_page(
            page, nonce=nonce, context=self.context))

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
        ])


def _page_arguments(request: Request) -> dict[str, Any]:
    params = request.query_params
    unknown = set(params) - {"state", "cursor", "limit"}
    if unknown:
        raise errors.InvalidRequest(f"unknown parameter(s): {', '.join(sorted(unknown))[:100]}")
    text = params.get("limit", str(DEFAULT_PAGE))
    if not text.isdigit() or len(text) > 4:
        raise errors.InvalidRequest("limit: an integer 1..200")
    return {"state": params.get("state", "all"), "cursor": params.get("cursor"),
            "limit": int(text)}


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form of at most ``MAX_FORM_BYTES`` (no multipart)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/x-www-form-urlencoded":
        raise errors.InvalidRequest("a form (application/x-www-form-urlencoded) is expected")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise errors.InvalidRequest(f"the form is larger than {MAX_FORM_BYTES} bytes")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=20,
                          strict_parsing=bool(body))
    except (UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest("not a form of this dashboard") from None
    return dict(pairs)


def json_line(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True) + "\n"
