"""The dashboard's glossary: the words its pages use (fence, lease, preserve / reselect,
each availability value), explained in a popover every page carries and in the tooltip of
each availability shown.

The sentences are those of ``docs/architecture.md`` (section "Glossary"): one source. A
test reads the document and checks every sentence here is the one it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Final

__all__ = ["AVAILABILITY_TERMS", "TERMS", "availability_label", "glossary_popover"]

# Term -> its explanation (the text after the term's module in the document).
TERMS: Final[Mapping[str, str]] = {
    "Fence": (
        "a counter on each operation, incremented by every lease acquisition. Every write "
        "made under a lease is conditional on it (`FenceMismatch`), so a stale owner can "
        "never commit after a newer one took over."
    ),
    "Lease": (
        "the right of one execution to run an operation and write for it. It names its "
        "owner and its fence, and is live while that owner lives and it has not expired; "
        "nothing else writes for the operation while it is held."
    ),
    "Owner": (
        "an opened store, with an opaque id. On LMDB it holds an exclusive `flock` the "
        "kernel releases when the process dies; its leases are live only while it does."
    ),
    "Sweep": (
        "closes what dead owners left behind, one fenced write per operation "
        "(`owner_lost`), ends unclaimed work (`no_worker`) and names damaged rows; it never "
        "touches an operation of a live owner."
    ),
    "Preserve / reselect": (
        "preserve copies the source's frozen body and configuration byte for byte; "
        "reselect runs preparation again on the original request with the runtime's "
        "selector (an explicit per-request model stays binding), then freezes the "
        "successor. Either way the response contract, scope, job and revision are kept."
    ),
}

# Availability value -> what it means (the document's sub-list of "Availability").
AVAILABILITY_TERMS: Final[Mapping[str, str]] = {
    "ready": (
        "prepared, or interrupted before any attempt: execute it (no budget is spent until "
        "an attempt is consumed)."
    ),
    "running": "a live lease holds it: an execution is generating it now.",
    "waiting": (
        "in a saved cooldown (a retry delay or a rate limit) until its next attempt time; "
        "it runs again after it."
    ),
    "replacement_eligible": (
        "an attempt was interrupted and budget is left: executing it again replaces (or "
        "resumes) that attempt."
    ),
    "completion_saved": "its validated result is saved: read the receipt, then acknowledge.",
    "suspended": "stopped from outside with budget left: resume it to go on.",
    "exhausted": (
        "its attempt budget (or token or cost budget) is spent: only a deliberate manual "
        "retry can continue."
    ),
    "authentication_required": (
        "the provider refused the credentials even after renewing them: sign in to the "
        "same account again."
    ),
    "permanently_cancelled": "cancelled: it never runs or delivers again; abandon it.",
    "failed": (
        "ended by a terminal failure (rejected, quota, invalid output, owner lost, ...): a "
        "manual retry creates a successor if the work is still wanted."
    ),
    "expired": "its attempt permission (`expires_at`) ran out before it completed.",
    "acknowledged": (
        "its result was delivered and acknowledged; only a small marker is left."
    ),
    "abandoned": "given up; only a small marker is left.",
    "blocked": (
        "something outside it must change first (the blockers say what: another account, "
        "endpoint or configuration, or missing storage)."
    ),
    "endpoint_unavailable": "its endpoint could not be connected to; nothing was spent.",
    "superseded": "its source changed or was deleted: prepare a new operation.",
    "continuation_pending": (
        "failed, and an opt-in continuation will create its one successor at its due time "
        "unless something cancels it first."
    ),
}


def _plain(text: str) -> str:
    """The document's text as a tooltip shows it (no Markdown backticks)."""
    return text.replace("`", "")


def availability_label(value: str, *, element_id: str = "") -> str:
    """An availability value, with its meaning as a tooltip (``<abbr title>``)."""
    meaning = AVAILABILITY_TERMS.get(value)
    id_attribute = f' id="{escape(element_id)}"' if element_id else ""
    if meaning is None:
        return f"<span{id_attribute}>{escape(value)}</span>"
    return (f'<abbr class="term"{id_attribute} title="{escape(_plain(meaning))}">'
            f"{escape(value)}</abbr>")


def glossary_popover() -> str:
    """The "Glossary" popover of the header: a ``<details>`` (no script) that opens a
    list of the terms and of the availability values."""
    terms = "".join(
        f"<dt>{escape(term)}</dt><dd>{escape(_plain(text))}</dd>"
        for term, text in TERMS.items()
    )
    values = "".join(
        f'<dt><code>{escape(value)}</code></dt><dd>{escape(_plain(text))}</dd>'
        for value, text in AVAILABILITY_TERMS.items()
    )
    return (
        '<details id="glossary" class="glossary"><summary>Glossary</summary>'
        f'<div class="glossary-body"><dl id="glossary-terms">{terms}</dl>'
        f'<h3>Availability</h3><dl id="glossary-availability">{values}</dl></div></details>'
    )
