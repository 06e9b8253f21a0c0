"""The console's HTML: the filtered operations list (its filter form, sorts and bulk
controls), a bulk action's preview (how many and which, what the rules refuse, one
confirmation) and its result. Every value is escaped; forms carry the session's CSRF
token; no inline ``style=`` or event handler (the Content-Security-Policy forbids them).
"""

from __future__ import annotations

from html import escape
from typing import Final, get_args
from urllib.parse import urlencode

from recoverable.cli.bulk import BULK_ACTIONS, BulkOptions, BulkPreview, BulkResult
from recoverable.cli.selection import SORTS, FilteredPage
from recoverable.dashboard.data import STATES
from recoverable.dashboard.glossary import availability_label
from recoverable.dashboard.html import clipped, full_time, operation_link, table
from recoverable.dashboard.pages import layout
from recoverable.types import Availability

__all__ = ["bulk_preview_page", "bulk_result_page", "list_url", "operations_page"]

SHOWN: Final = 200  # ids a preview or a result lists (the count says how many in all)
_AVAILABILITIES: Final[tuple[str, ...]] = get_args(Availability)

# Ticking "every operation matching the filter" or a row's box: nothing else (no inline
# handler: the CSP forbids them).
_SELECT_JS: Final = """
(function(){
  var all = document.getElementById('select-page');
  if (all) { all.addEventListener('change', function(){
    document.querySelectorAll('input[name=ids]').forEach(function(box){
      box.checked = all.checked; });
  }); }
})();
"""


def list_url(**params: str) -> str:
    """A link to the operations list filtered by ``params`` (empty values left out)."""
    kept = {key: value for key, value in params.items() if value}
    return "/operations" + (f"?{urlencode(kept)}" if kept else "")


def _select(name: str, options: tuple[str, ...], chosen: str, *, blank: str) -> str:
    items = [f'<option value="">{escape(blank)}</option>'] + [
        f'<option value="{escape(option)}"{" selected" if option == chosen else ""}>'
        f"{escape(option)}</option>" for option in options]
    return f'<select name="{name}" id="filter-{name}">{"".join(items)}</select>'


def _input(name: str, value: str, placeholder: str, width: int = 12) -> str:
    return (f'<input name="{name}" id="filter-{name}" value="{escape(value)}" '
            f'placeholder="{escape(placeholder)}" size="{width}">')


def _filter_form(page: FilteredPage) -> str:
    given = page.filter.params()
    return (
        '<form method="get" action="/operations" id="filter-form" class="filters">'
        + _input("q", given.get("q", ""), "operation or job id prefix", 22)
        + _select("state", STATES, given.get("state", ""), blank="any state")
        + _select("availability", _AVAILABILITIES, given.get("availability", ""),
                  blank="any availability")
        + _input("kind", given.get("kind", ""), "failure kind")
        + _input("code", given.get("code", ""), "failure code")
        + _input("model", given.get("model", ""), "model")
        + _input("owner", given.get("owner", ""), "owner id prefix")
        + _input("since", given.get("since", ""), "since (UTC ISO)", 18)
        + _input("until", given.get("until", ""), "until (UTC ISO)", 18)
        + _select("time", ("updated", "created"), given.get("time", ""), blank="time: updated")
        + _select("sort", SORTS[1:], "" if page.sort == "created" else page.sort,
                  blank="sort: created")
        + _select("order", ("asc",), "" if page.descending else "asc", blank="newest first")
        + '<button type="submit" id="filter-apply">Find</button> '
        '<a href="/operations" id="filter-clear">clear</a></form>'
    )


def _bulk_controls(page: FilteredPage, csrf: str, can_act: str | None) -> str:
    token = f'<input type="hidden" name="csrf" value="{escape(csrf)}">'
    if can_act is not None:
        return token + f'<p class="muted" id="bulk-why">bulk actions: {escape(can_act)}</p>'
    actions = "".join(f'<option value="{action}">{action}</option>' for action in BULK_ACTIONS)
    return (
        token +
        f'<input type="hidden" name="filter" value="{escape(page.filter.text())}">'
        f'<input type="hidden" name="sort" value="{escape(page.sort)}">'
        f'<input type="hidden" name="order" value="{"desc" if page.descending else "asc"}">'
        '<div class="bulk" id="bulk-controls"><b>Act on many:</b> '
        f'<select name="action" id="bulk-action">{actions}</select> '
        '<label><input type="radio" name="target" value="selected" id="bulk-target-selected"'
        ' checked> the ticked operations</label> '
        '<label><input type="radio" name="target" value="filter" id="bulk-target-filter"> '
        f"every operation matching this filter ({page.matching})</label> "
        '<span class="muted">retry: </span><select name="selection" id="bulk-selection">'
        '<option value="preserve">preserve</option><option value="reselect">reselect'
        '</option></select> <input name="max_attempts" id="bulk-budget" size="4" '
        'placeholder="budget"> <label><input type="checkbox" name="force" value="1" '
        'id="bulk-force"> cancel also saved results</label> '
        '<button type="submit" id="bulk-preview">Preview…</button></div>'
    )


def _owner(owner_id: str | None, *, orphaned: bool) -> str:
    """The lease owner's cell: its id, and "orphaned" when its process is gone."""
    if owner_id is None:
        return ""
    flag = (' <span class="bad" title="its owner\'s process is gone: recoverable sweep '
            'closes it">orphaned</span>') if orphaned else ""
    return clipped(owner_id) + flag


def operations_page(page: FilteredPage, *, csrf: str, can_act: str | None, nonce: str,
                    context: str) -> str:
    """The list: its filter form, the rows (ticked for a bulk action) and the next page."""
    states = " ".join(
        (f"<b>{escape(state)}</b>" if state == page.state
         else f'<a href="{escape(list_url(**{**page.params(), "state": state}))}">'
              f"{escape(state)}</a>")
        for state in ("all", *STATES)
    )
    rows = table(
        ('<input type="checkbox" id="select-page" title="this page">', "operation", "job",
         "state", "availability", "attempts", "failure", "code", "model", "owner",
         "created (disposed: when)", "updated"),
        ([f'<input type="checkbox" name="ids" value="{escape(row.operation_id)}" '
          f'class="pick">',
          operation_link(row.operation_id), escape(row.job_id or "-"),
          f'<span class="state">{escape(row.state)}</span>', availability_label(row.availability),
          f"{row.attempts_used}/{row.maximum_attempts}",
          f"<code>{escape(row.failure)}</code>" if row.failure else "",
          f"<code>{escape(row.failure_code)}</code>" if row.failure_code else "",
          escape(row.model or "-"), _owner(row.owner, orphaned=row.orphaned),
          full_time(row.created_at), full_time(row.updated_at)] for row in page.rows),
        empty="no operation matches this filter",
        raw_head=True,
    )
    more = ""
    if page.next_cursor is not None:
        url = list_url(**page.params(cursor=page.next_cursor, limit=str(page.limit)))
        more = f'<p><a id="next-page" href="{escape(url)}">next page</a></p>'
    order = "newest first" if page.sort == "created" else f"by {page.sort}"
    if not page.descending:
        order = "oldest first" if page.sort == "created" else f"by {page.sort}, smallest first"
    body = (
        f"<h1>Operations</h1><nav class=filter>{states}</nav>{_filter_form(page)}"
        f'<p class="muted"><span id="matching">{page.matching}</span> operation(s) match '
        f'<code id="filter-text">{escape(page.filter.describe())}</code>; {page.limit} per '
        f"page, {order}</p>"
        '<form method="post" action="/bulk/preview" id="bulk-form">'
        f"{_bulk_controls(page, csrf, can_act)}{rows}</form>{more}"
    )
    return layout("Operations", body, nonce=nonce, context=context, script=_SELECT_JS)


def _what(action: str, options: BulkOptions) -> str:
    if action == "retry":
        budget = ("the source's budget" if options.max_attempts is None
                  else f"a budget of {options.max_attempts} attempt(s)")
        return f"manual retry ({options.selection}, {budget})"
    if action == "cancel" and options.force:
        return "cancel (also operations with a saved result: never delivered)"
    return action


def bulk_preview_page(preview: BulkPreview, options: BulkOptions, *, action_id: str,
                      described: str, csrf: str, nonce: str, context: str) -> str:
    """How many and which, what the rules refuse now, and the one confirmation."""
    refused = dict(preview.refused)
    reasons = table(("refused now, because", "operations"),
                     ([escape(reason), str(count)] for reason, count in preview.reasons()),
                     empty="the rules refuse none of them now")
    listed = table(
        ("operation", "now"),
        ([operation_link(op_id), escape(refused.get(op_id, "allowed"))]
         for op_id in preview.operation_ids[:SHOWN]), empty="no operation selected")
    rest = len(preview.operation_ids) - SHOWN
    more = f'<p class="muted">and {rest} more</p>' if rest > 0 else ""
    confirm = ""
    if preview.allowed:
        confirm = (
            '<form method="post" action="/bulk/confirm" id="bulk-confirm-form">'
            f'<input type="hidden" name="csrf" value="{escape(csrf)}">'
            f'<input type="hidden" name="action_id" value="{escape(action_id)}">'
            f'<button type="submit" class="danger" id="bulk-confirm">Confirm: '
            f"{escape(preview.action)} {preview.allowed} operation(s)</button> "
            '<a href="/operations" id="bulk-back">back to the list</a></form>')
    body = (
        f"<h1>Preview: {escape(_what(preview.action, options))}</h1>"
        f'<p>Selection: <code id="bulk-filter">{escape(described)}</code>: '
        f'<b id="bulk-count">{len(preview.operation_ids)}</b> operation(s); '
        f'<b id="bulk-allowed">{preview.allowed}</b> allowed now, '
        f'<b id="bulk-refused">{len(preview.refused)}</b> refused. Nothing is done until '
        "you confirm; each operation is checked again when it is done (action id "
        f'<code id="bulk-action-id">{escape(action_id)}</code>: confirming it again does '
        f"nothing twice).</p>{confirm}<h2>Refusals</h2>{reasons}"
        f"<h2>Operations</h2>{listed}{more}"
    )
    return layout("Bulk preview", body, nonce=nonce, context=context)


def bulk_result_page(result: BulkResult, *, note: str | None, nonce: str,
                     context: str) -> str:
    """How many were done, how many refused and why."""
    reasons = table(("refused, because", "operations"),
                     ([escape(reason), str(count)] for reason, count in result.reasons()),
                     empty="none was refused")
    done = table(("operation", "what happened"),
                  ([operation_link(op_id), escape(text)] for op_id, text in result.done[:SHOWN]),
                  empty="nothing was done")
    refused = table(("operation", "code", "why"),
                     ([operation_link(op_id), f"<code>{escape(code)}</code>", escape(why)]
                      for op_id, code, why in result.refused[:SHOWN]), empty="none")
    banner = f'<p class="flash" id="bulk-note">{escape(note)}</p>' if note else ""
    body = (
        f"<h1>Bulk {escape(result.action)}: result</h1>{banner}"
        f'<p><b id="result-done">{len(result.done)}</b> done, '
        f'<b id="result-refused">{len(result.refused)}</b> refused, of '
        f'<span id="result-selected">{result.selected}</span> selected (action id '
        f"<code>{escape(result.action_id)}</code>).</p>"
        f"<h2>Refusals by reason</h2>{reasons}<h2>Done</h2>{done}<h2>Refused</h2>{refused}"
    )
    return layout("Bulk result", body, nonce=nonce, context=context)
