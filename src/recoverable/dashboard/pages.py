"""The dashboard's HTML: server-rendered pages, inline CSS and a little vanilla JavaScript
(no build step), every value escaped. Charts are inline SVG.

Every ``<style>`` and ``<script>`` carries the response's CSP nonce; no inline ``style=``
attribute or event handler is used (the Content-Security-Policy forbids them).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from html import escape
from typing import Final
from urllib.parse import quote, urlencode

from recoverable.dashboard.data import STATES, OperationView, Summary
from recoverable.dashboard.explain import (
    attempt_timing,
    explanation_html,
    failure_sentence,
    lineage_html,
    time_rows,
)
from recoverable.dashboard.fleet import fleet_html
from recoverable.dashboard.glossary import availability_label, glossary_popover
from recoverable.dashboard.html import (
    clipped,
    clock,
    full_time,
    operation_link,
    short_id,
    table,
)
from recoverable.pricing import usage_text

__all__ = [
    "ActionButton",
    "error_page",
    "operation_page",
    "overview_live",
    "overview_page",
]

_CSS: Final = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:10px 20px;display:flex;gap:24px;align-items:center}
header a{color:#cfe0ff;text-decoration:none}header b{font-size:16px}
main{padding:16px 20px;max-width:1200px}
h1{font-size:20px;margin:4px 0 12px}h2{font-size:15px;margin:18px 0 6px}
.cards{display:flex;flex-wrap:wrap;gap:8px}
.card{background:#fff;border:1px solid #d8dde6;border-radius:6px;padding:8px 12px;min-width:92px;
color:inherit;text-decoration:none}a.card:hover{border-color:#3b6fd4}
.filters input,.filters select{margin:0 4px 6px 0}.bulk{margin:8px 0;padding:6px 8px;
background:#eef1f5;border-radius:4px}
.card .n{font-size:22px;font-weight:600}.card .l{color:#5b6678;font-size:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px}
.box{background:#fff;border:1px solid #d8dde6;border-radius:6px;padding:8px 12px;
overflow-x:auto}
table{border-collapse:collapse;width:100%;background:#fff}
td,th{border-bottom:1px solid #e4e7ed;padding:4px 8px;text-align:left;font-size:13px}
th{background:#eef1f5}code{font-size:12px}
.muted{color:#6b7587}.bad{color:#a3231b}.ok{color:#1f7a35}
.actions form{display:inline-block;margin:0 8px 8px 0}
button{padding:5px 12px;border:1px solid #8a94a6;border-radius:4px;background:#fff;cursor:pointer}
button.danger{border-color:#a3231b;color:#a3231b}
.flash{background:#e6f4ea;border:1px solid #9fd3ad;padding:6px 10px;border-radius:4px}
.error{background:#fbe9e7;border:1px solid #e5a39b;padding:6px 10px;border-radius:4px}
nav.filter a{margin-right:10px}
.clip{display:inline-block;max-width:22em;overflow:hidden;text-overflow:ellipsis;
white-space:nowrap;vertical-align:bottom}
h1 .clip{max-width:40em}
.chain{list-style:none;padding:0;margin:4px 0;display:flex;flex-wrap:wrap;gap:4px}
.chain li+li:before{content:"\\2192";margin-right:4px;color:#6b7587}
.chain .clip{max-width:14em}
abbr.term{text-decoration:underline dotted;cursor:help}
details.glossary{margin-left:auto;position:relative}
details.glossary summary{cursor:pointer;color:#cfe0ff}
.glossary-body{position:absolute;right:0;z-index:10;width:34em;max-height:70vh;overflow:auto;
background:#fff;color:#1d2430;border:1px solid #d8dde6;border-radius:6px;padding:8px 12px;
box-shadow:0 4px 16px rgba(0,0,0,.2)}
.glossary-body dt{font-weight:600;margin-top:6px}.glossary-body dd{margin:0 0 0 12px}
.glossary-body h3{font-size:14px;margin:10px 0 0}
pre{white-space:pre-wrap;background:#fff;border:1px solid #d8dde6;padding:8px;max-height:360px;
overflow:auto}
"""

# The overview polls one small JSON endpoint instead of holding an event stream: a
# stream per tab held one of the six connections a browser allows per host (the seventh
# tab hung) and ran into the server's cap on streams (the ninth got a 503 it never
# showed). A poll holds a connection only while it is answered; when polls fail the page
# says so and backs off (2 s doubling to 30 s), and says "live" again only once one
# succeeds.
_LIVE_JS: Final = """
(function(){
  var region = document.getElementById('live');
  var state = document.getElementById('live-state');
  var reason = document.getElementById('live-reason');
  var version = region.getAttribute('data-version');
  var PERIOD = 2000, LONGEST = 30000, TIMEOUT = 10000;
  var failures = 0;
  function show(text, css, why){
    state.textContent = text; state.className = css; reason.textContent = why;
  }
  function fail(status, why){
    failures += 1;
    if (status === 401 || status === 403) {
      show('disconnected', 'bad', ': ' + why + ' (open the printed URL again)');
      return;
    }
    var delay = Math.min(PERIOD * Math.pow(2, failures), LONGEST);
    var text = status >= 500 && status !== 502 && status !== 504 ? 'not updated'
      : 'disconnected';
    show(text, 'bad', ': ' + why + '; retrying in ' + Math.round(delay / 1000) + ' s');
    window.setTimeout(poll, delay);
  }
  function poll(){
    var controller = new AbortController();
    var timer = window.setTimeout(function(){ controller.abort(); }, TIMEOUT);
    fetch('/api/overview?since=' + encodeURIComponent(version),
          {credentials: 'same-origin', cache: 'no-store', signal: controller.signal})
      .then(function(response){
        return response.json().catch(function(){ return {}; }).then(function(data){
          return {status: response.status, data: data};
        });
      })
      .then(function(answer){
        window.clearTimeout(timer);
        var data = answer.data;
        if (answer.status !== 200 || data.version === undefined) {
          var code = data.error ? data.error + ': ' + (data.message || '') : '';
          fail(answer.status, code || 'the dashboard answered ' + answer.status);
          return;
        }
        if (data.html !== undefined) {
          region.innerHTML = data.html;
          version = String(data.version);
        }
        failures = 0;
        show('live', 'ok', '');
        window.setTimeout(poll, PERIOD);
      }, function(){
        window.clearTimeout(timer);
        fail(0, 'the dashboard does not answer');
      });
  }
  window.setTimeout(poll, PERIOD);
})();
"""

_CONFIRM_JS: Final = """
document.querySelectorAll('form[data-confirm]').forEach(function(form){
  form.addEventListener('submit', function(event){
    if (!window.confirm(form.getAttribute('data-confirm'))) { event.preventDefault(); }
  });
});
"""


def _when(moment: _dt.datetime | None) -> str:
    return "-" if moment is None else full_time(moment.timestamp())


def layout(title: str, body: str, *, nonce: str, context: str, script: str = "") -> str:
    scripts = f'<script nonce="{nonce}">{script}</script>' if script else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)} - recoverable</title>"
        f'<style nonce="{nonce}">{_CSS}</style></head><body>'
        '<header><b>recoverable</b><a href="/" id="nav-overview">Overview</a>'
        '<a href="/operations" id="nav-operations">Operations</a>'
        f'<span class="muted">{escape(context)}</span>{glossary_popover()}</header>'
        f"<main>{body}</main>{scripts}</body></html>"
    )


def _filtered(text: str, **params: str) -> str:
    """``text`` (already escaped) as a link to the operations list filtered by ``params``."""
    return f'<a href="/operations?{escape(urlencode(params))}">{text}</a>'


def _cards(items: Iterable[tuple[str, str, object]]) -> str:
    """Count cards; each card is a link to its filtered list."""
    return '<div class="cards">' + "".join(
        '<a class="card" href="/operations'
        + (f"?{escape(urlencode({'state': key.split('.', 1)[1]}))}"
           if key.startswith("by_state.") else "")
        + f'"><div class="n" data-count="{escape(key)}" id="count-'
        f'{escape(key.replace(".", "-"))}">{escape(str(value))}</div>'
        f'<div class="l">{escape(label)}</div></a>'
        for label, key, value in items
    ) + "</div>"


def _bars(values: Sequence[tuple[str, int]], *, width: int = 520, height: int = 120,
          title: str) -> str:
    """A small bar chart as inline SVG (labels as <title> tooltips)."""
    if not values:
        return '<p class="muted">no data yet</p>'
    peak = max(value for _, value in values) or 1
    step = min(width / len(values), 48.0)
    bars = []
    for index, (label, value) in enumerate(values):
        bar = (height - 16) * value / peak
        bars.append(
            f'<rect x="{index * step + 1:.1f}" y="{height - 14 - bar:.1f}" '
            f'width="{max(step - 2, 1):.1f}" height="{bar:.1f}" fill="#3b6fd4">'
            f"<title>{escape(label)}: {value}</title></rect>"
        )
    first, last = escape(values[0][0]), escape(values[-1][0])
    return (
        f'<svg role="img" aria-label="{escape(title)}" width="100%" '
        f'viewBox="0 0 {width} {height}">' + "".join(bars)
        + f'<text x="0" y="{height - 2}" font-size="10" fill="#6b7587">{first}</text>'
        + f'<text x="{width}" y="{height - 2}" font-size="10" fill="#6b7587" '
        f'text-anchor="end">{last}</text>'
        + f'<text x="0" y="10" font-size="10" fill="#6b7587">max {peak}</text></svg>'
    )


def overview_live(summary: Summary) -> str:
    """Everything the overview shows of the store, from one summary (one rebuild): the
    page's first render and each of its updates (``/api/overview``), so no two panels can
    show two different reads."""
    counts = summary.counts()
    states = [(state, f"by_state.{state}", summary.by_state[state]) for state in STATES]
    cards = _cards([("operations", "total", counts["total"]), *states])
    availability = table(
        ("availability", "operations"),
        ([availability_label(name), _filtered(
            f'<span data-count="by_availability.{escape(name)}">{count}</span>',
            availability=name)]
         for name, count in summary.by_availability.items()),
        empty="no operations",
    )
    failures = table(
        ("typed failure", "failed operations"),
        ([f"<code>{escape(kind)}</code>",
          _filtered(str(count), state="failed", kind=kind)] for kind, count in summary.failures),
        empty="no failed operation",
    )
    throughput = _bars(
        [(_dt.datetime.fromtimestamp(minute, _dt.UTC).strftime("%H:%M"), completed)
         for minute, completed, _ in summary.throughput],
        title="completed per minute",
    )
    posts = _bars(
        [(_dt.datetime.fromtimestamp(minute, _dt.UTC).strftime("%H:%M"), spent)
         for minute, _, spent in summary.throughput],
        title="attempts spent per minute",
    )
    histogram = _bars(
        [(f"{attempts} attempt(s)", count) for attempts, count in summary.attempts_histogram],
        title="operations by attempts used",
    )
    tokens = usage_text(summary.usage) if summary.usage_reported else None
    cost = _cost_text(summary)
    cooldowns = table(
        ("operation", "cooldown until (UTC)"),
        ([operation_link(op_id), clock(until)] for op_id, until in summary.cooldowns),
        empty="no saved cooldown",
    )
    governors = table(
        ("endpoint", "ops", "shared pause", "requests", "tokens"),
        ([escape(gov.endpoint_id), str(gov.operations),
          '<span class="bad">until ' + clock(gov.paused_until) + "</span>"
          if gov.paused_until else "none",
          "full" if gov.requests_level is None else f"{gov.requests_level:.1f}",
          "full" if gov.tokens_level is None else f"{gov.tokens_level:.0f}"]
         for gov in summary.governors),
        empty="no endpoint yet",
    )
    return (
        f'<p class="muted">updated <span id="updated">{full_time(summary.built_at)}</span>'
        f" (one read of the store took {summary.build_seconds * 1000:.0f} ms); "
        + _filtered(f'<span data-count="waiting" id="count-waiting">{summary.waiting}</span>',
                    availability="waiting")
        + f" in a saved cooldown; {summary.unreadable} unreadable record(s)</p>"
        f"{cards}"
        '<div class="grid">'
        '<div class="box" id="panel-throughput"><h2>Completed per minute (last hour; '
        f"acknowledged ones at their acknowledgement)</h2>{throughput}</div>"
        '<div class="box" id="panel-spent"><h2>Attempts spent per minute (records in the '
        f"store)</h2>{posts}</div>"
        f'<div class="box" id="panel-histogram"><h2>Attempts per job</h2>{histogram}</div>'
        f'<div class="box" id="panel-availability"><h2>Availability</h2>{availability}</div>'
        f'<div class="box" id="panel-failures"><h2>Failures by typed kind</h2>{failures}</div>'
        '<div class="box" id="panel-usage"><h2>Tokens and cost</h2>'
        f"<p>{escape(tokens or 'no usage reported yet')}</p><p>cost: {escape(cost)}</p></div>"
        f'<div class="box" id="panel-cooldowns"><h2>Cooldowns (soonest)</h2>{cooldowns}</div>'
        f'<div class="box" id="panel-governor"><h2>Rate governor</h2>{governors}</div>'
        + fleet_html(summary.owners, summary.workers, summary.pace) +
        "</div>"
    )


def overview_page(summary: Summary, version: int, *, nonce: str, context: str) -> str:
    """The overview: the live region (``overview_live``) and the state of its updates."""
    body = (
        '<h1>Overview</h1><p><span id="live-state" class="ok">live</span>'
        '<span id="live-reason"></span></p>'
        f'<div id="live" data-version="{version}">{overview_live(summary)}</div>'
    )
    return layout("Overview", body, nonce=nonce, context=context, script=_LIVE_JS)


def _cost_text(summary: Summary) -> str:
    """The estimated cost, or why there is none (never a bare "-")."""
    if not summary.usage_reported:
        return "none yet (no usage reported)"
    if summary.cost is None:
        return (f"unknown: no price for {', '.join(summary.unpriced)} (give its prices with "
                "--prices FILE)")
    return f"${summary.cost:.4f} (estimate; prices: {summary.price_source})"


class ActionButton:
    """One action form of the operation page (or why it is not offered)."""

    def __init__(self, action: str, label: str, *, disabled: str | None = None,
                 confirm: str | None = None, fields: dict[str, str] | None = None,
                 danger: bool = False, suffix: str = "") -> None:
        self.action = action
        self.element_id = f"action-{action}" + (f"-{suffix}" if suffix else "")
        self.label = label
        self.disabled = disabled
        self.confirm = confirm
        self.fields = fields or {}
        self.danger = danger

    def render(self, operation_id: str, csrf: str) -> str:
        if self.disabled is not None:
            return (f'<form><button type="button" disabled id="{self.element_id}">'
                    f"{escape(self.label)}</button> "
                    f'<span class=muted id="{self.element_id}-why">'
                    f"{escape(self.disabled)}</span></form>")
        confirm = f' data-confirm="{escape(self.confirm)}"' if self.confirm else ""
        hidden = "".join(
            f'<input type="hidden" name="{escape(key)}" value="{escape(value)}">'
            for key, value in {"csrf": csrf, **self.fields}.items()
        )
        css = ' class="danger"' if self.danger else ""
        return (
            f'<form method="post" action="/operations/{quote(operation_id, safe="")}/'
            f'{self.action}"{confirm}>{hidden}<button type="submit"{css} '
            f'id="{self.element_id}">{escape(self.label)}</button></form>'
        )


def operation_page(
    view: OperationView,
    actions: Sequence[ActionButton],
    *,
    csrf: str,
    nonce: str,
    context: str,
    flash: str | None,
    error: str | None,
) -> str:
    status = view.status
    op_id = status.operation_id
    dimensions = table(("dimension", "value"), [
        ["state", f'<b id="op-state">{escape(status.state)}</b>'],
        ["availability", availability_label(status.availability, element_id="op-availability")],
        ["blockers", escape(", ".join(sorted(status.blockers)) or "none")],
        ["suggested actions", escape(", ".join(status.suggested_actions) or "none")],
        ["attempts", f"{status.attempts_used} used of {status.maximum_attempts} "
                     f"({status.attempts_remaining} remaining)"],
        ["saved completion", "yes" if status.has_saved_completion else "no"],
        ["next attempt at (cooldown)", _when(status.next_attempt_at)],
        ["expires at", _when(status.expires_at)],
        ["rate limited", escape(status.rate_limited or "no")
         + (f" until {_when(status.rate_limited_until)}" if status.rate_limited_until else "")
         + (f"; endpoint paused until {full_time(view.paused_until)}"
            if view.paused_until else "")],
        ["queue", escape(status.queue or "-")],
        ["lease owner", clipped(status.lease_owner) +
                        f" (expires {_when(status.lease_expires_at)})" + _orphaned(view)],
        ["endpoint failure", escape(status.endpoint_failure or "-")],
        ["model", escape(status.model or "-")],
        ["tokens", escape(usage_text(status.usage) or "none reported")],
        *time_rows(view.record, view.marker),
    ], empty="")
    lineage = table(("lineage", "value"), [
        ["job", escape(status.job_id or "-")],
        ["input revision", escape(status.input_revision or "-")],
        ["scope", escape(status.scope or "-")],
        ["root operation", _linked(status.root_operation_id)],
        ["previous (source of a manual retry)",
         _linked(status.previous_operation_id)],
        ["successor (manual retry)", _linked(status.successor_id)],
        ["pending attempt (reserved, not yet authorized)",
         clipped(status.pending_attempt_id)],
        ["fence (lease generation)", str(status.fence)],
    ], empty="")
    stored = {attempt.attempt_id: attempt
              for attempt in (view.record.attempts if view.record is not None else ())}
    timeline = table(
        ("#", "reason", "started (authorized and consumed)", "ended", "duration",
         "time to first event", "outcome", "events streamed", "response id",
         "what happened", "typed failure", "tokens"),
        ([str(attempt.number), escape(attempt.reason),
          *(attempt_timing(view.record, stored[attempt.attempt_id])
            if attempt.attempt_id in stored else ("-",) * 4),
          f'<span class="{"ok" if attempt.outcome == "completed" else "bad"}">'
          f"{escape(attempt.outcome)}</span>",
          "-" if attempt.sequence_number is None else str(attempt.sequence_number),
          clipped(attempt.response_id), escape(failure_sentence(attempt.failure)),
          _failure(attempt.failure), escape(usage_text(attempt.usage) or "-")]
         for attempt in status.attempts),
        empty=_no_timeline(view),
    )
    notes = ""
    if flash:
        notes += f'<p class="flash" id="flash">{escape(flash)}</p>'
    if error:
        notes += f'<p class="error" id="action-error">{escape(error)}</p>'
    buttons = "".join(action.render(op_id, csrf) for action in actions)
    content = ""
    if view.content is not None:
        request, completion = view.content
        # A cancel fences the completion off but keeps it until an abandon: say so
        # where it is still shown.
        fenced = ('<p class="muted" id="content-fenced">cancelled: never delivered; it stays '
                  "in the store until you Abandon the operation</p>"
                  if completion is not None and status.state == "cancelled" else "")
        content = ("<h2>Content (--show-content, your account)</h2><h3>Frozen request</h3>"
                   f"<pre>{escape(request or '(removed)')}</pre><h3>Saved completion</h3>"
                   f"{fenced}<pre>{escape(completion or '(none)')}</pre>")
    chain = lineage_html(view.chain) if view.chain is not None else ""
    body = (
        f"<h1>Operation {clipped(op_id)}</h1>{notes}"
        f'<div class="actions">{buttons}</div>'
        + explanation_html(view.explanation, status.last_failure, status.state)
        + f'<div class="grid"><div class="box"><h2>Status</h2>{dimensions}</div>'
        f'<div class="box"><h2>Job and lineage</h2>{chain}{lineage}</div></div>'
        # Its many columns scroll inside their box: a long row never widens the page.
        f'<h2>Attempt timeline</h2><div class="box" id="timeline">{timeline}</div>{content}'
    )
    return layout(f"Operation {op_id}", body, nonce=nonce, context=context, script=_CONFIRM_JS)


def _orphaned(view: OperationView) -> str:
    """The flag of an operation whose lease names an owner whose process is gone."""
    if view.orphaned_by is None:
        return ""
    return ('<br><span class="bad" id="op-orphaned">orphaned: its lease names the owner '
            f"{short_id(view.orphaned_by)}, whose process is gone; <code>recoverable sweep "
            "--store STORE</code> closes it</span>")


def _linked(operation_id: str | None) -> str:
    return "-" if operation_id is None else operation_link(operation_id)


def _no_timeline(view: OperationView) -> str:
    """Why the timeline is empty. An acknowledged or abandoned operation keeps only a
    small marker: its attempts left the store with its record, they were not missing."""
    marker = view.marker
    if marker is None:
        return "no attempt authorized yet"
    return (f"{marker.attempts_used} attempt(s) used; their timeline was removed with the "
            f"operation's record when it was {marker.disposition} (only a small marker "
            "is kept)")


def _failure(failure: object) -> str:
    if failure is None:
        return "-"
    parts = []
    for name in ("kind", "http_status", "provider_type", "provider_code", "transport_code",
                 "output_path"):
        value = getattr(failure, name, None)
        if value is not None:
            parts.append(f"{name}={value}")
    return f"<code>{escape(' '.join(parts))}</code>"


def error_page(status: int, code: str, message: str, *, nonce: str, context: str) -> str:
    body = (f'<h1>{status}</h1><p class="error" id="error-code">{escape(code)}: '
            f"{escape(message)}</p>")
    return layout(f"{status} {code}", body, nonce=nonce, context=context)
