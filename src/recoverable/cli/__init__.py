"""The ``recoverable`` command line: the batch host and store operations.

``recoverable batch JOBS.jsonl --out RESULTS.jsonl`` runs a file of jobs durably
(see ``recoverable.cli.batch``). ``status|inventory|receipt|acknowledge|abandon|
suspend|cancel|retry|purge --store DIR`` operate on a store from the shell
(``--json`` for machine output), always within the account given by
``--account`` (``recoverable.cli.ops``). ``sweep --store DIR`` runs the store-wide
recovery sweep (``recoverable.cli.sweep``). ``fixture-provider`` runs the loopback test
provider.

Exit codes: 0 success, 1 a job or an operation failed (or was not found),
2 usage or input error, 130 interrupted.

The modules, top to bottom: ``entry`` (``main``), ``arguments`` (the parser), ``ops`` and
``formatting`` (the store commands), ``sweep`` (the recovery sweep), ``batch`` (the batch
run), ``host`` (one batch's jobs over a runtime), ``progress`` (what a running batch
shows), ``provider`` (the fixture or a URL), ``report`` (summary and ``--errors``),
``result_log`` (the output file), ``jobs`` (job lines), ``config`` and ``exits``.
"""

from __future__ import annotations

from recoverable.cli.entry import main
from recoverable.cli.formatting import format_inventory, format_receipt, format_status

__all__ = ["format_inventory", "format_receipt", "format_status", "main"]
