"""The base of every ``recoverable`` error and the errors of a bad request.

``recoverable.errors`` re-exports every class here: import them from there. They live in
this module only to keep ``errors.py`` within the package's module-size rule; see
``errors.py`` for the rules every error follows (a stable ``code``, a readable ``str``
built only from the library's own text and typed fields).
"""

from __future__ import annotations

from typing import ClassVar

from recoverable.failure_text import bounded

__all__ = [
    "AccountRequired",
    "InvalidCredentials",
    "InvalidParameter",
    "InvalidRequest",
    "PriceUnknown",
    "RecoveryError",
    "RuntimeClosed",
    "TrioRequired",
    "UnsupportedInputItem",
    "UnsupportedOutputType",
]


class RecoveryError(Exception):
    """Base class of every error raised by ``recoverable``."""

    code: str = "recovery_error"
    # What happened / what to do, for ``str()`` (a subclass without them falls back to
    # its docstring and docs/failures.md).
    _summary: ClassVar[str] = ""
    _action: ClassVar[str] = ""

    def __init__(self, message: str = "", *, operation_id: str | None = None) -> None:
        super().__init__(message or self.code)
        self.operation_id = operation_id

    # --- the readable message (``str``); the typed fields above stay the API ----------

    @property
    def _detail(self) -> str:
        """The raiser's own detail text (``""`` when it gave none)."""
        first = self.args[0] if self.args else ""
        return first if isinstance(first, str) and first != self.code else ""

    def _what(self) -> str:
        """What happened (without the operation id)."""
        what = self._summary
        if not what:
            doc = (type(self).__doc__ or "").strip().splitlines()
            generic = type(self) is RecoveryError or not doc
            what = f"the operation failed ({self.code})" if generic else _sentence(doc[0])
        return with_detail(what, self._detail)

    def _todo(self) -> str:
        """What the host can do about it."""
        return self._action or f"see the {self.code} row in docs/failures.md"

    def what_happened(self) -> str:
        """What happened, as ``str()`` says it (without the operation id): the sentence a
        person reads, built from the library's own text and typed fields only."""
        return self._what()

    def what_to_do(self) -> str:
        """What to do about it, as ``str()`` says it after the ``;``."""
        return self._todo()

    def __str__(self) -> str:
        head = f"operation {self.operation_id}: " if self.operation_id else ""
        todo = self.what_to_do()
        return f"{head}{self.what_happened()}" + (f"; {todo}" if todo else "")


class InvalidRequest(RecoveryError, ValueError):
    """The request, schema or option given by the caller is invalid."""

    code = "invalid_request"
    _summary = "the request, schema or option is invalid"
    _action = "correct it and call again; nothing was saved"

    def _what(self) -> str:
        return self._detail or self._summary


class AccountRequired(InvalidRequest):
    """The runtime was opened without an account (``account=None``) and never signed in:
    preparing, submitting or listing work needs the account the credentials belong to."""

    code = "account_required"
    _summary = "an account is required: the runtime was opened with account=None"
    _action = (
        "pass account= (an AccountBinding, the one the credentials belong to) to "
        "open_runtime, or call sign_in first; nothing was saved"
    )


class UnsupportedInputItem(InvalidRequest):
    """An input item that continues a stored thread or replays tool history.

    ``item_index`` is its position in ``input`` and ``item_type`` its ``type``
    (``None`` when absent). Recovery sends tool-free, self-contained requests only.
    """

    code = "unsupported_input_item"

    def __init__(self, message: str, *, item_index: int, item_type: str | None) -> None:
        super().__init__(message)
        self.item_index = item_index
        self.item_type = item_type

    def _what(self) -> str:
        if self._detail:
            return self._detail
        kind = f"type {bounded(self.item_type)!r}" if self.item_type else "no type"
        return f"input item {self.item_index} ({kind}) is not a self-contained message"

    def _todo(self) -> str:
        return ("send self-contained input (messages with text, image or file content) "
                "without previous_response_id, item references or tool items")


class InvalidParameter(InvalidRequest):
    """A request parameter that is refused: a bad value, an unknown name, or one that needs
    tools or server-side state.

    ``parameter`` names it as the caller wrote it (``"temperature"``, ``"text.verbosity"``);
    ``reason`` is ``"invalid_value"``, ``"unknown"`` or ``"refused"`` (tools, stored
    responses, threads, prompts or background mode: recovery sends self-contained,
    tool-free requests only). Raised at prepare, before anything is saved or sent.
    """

    code = "invalid_parameter"

    def __init__(self, message: str, *, parameter: str, reason: str = "invalid_value") -> None:
        super().__init__(message)
        self.parameter = parameter
        self.reason = reason


class UnsupportedOutputType(InvalidRequest):
    """A ``response=`` type (pydantic model, dataclass, TypedDict) with a construct strict
    mode cannot express: a dict with arbitrary keys, ``Any``, a tuple, a set, an
    undiscriminated ``oneOf``, a keyword or string format outside the supported set.

    ``field_path`` names the field (``Basket.items[].tags``) and ``keyword`` the JSON
    Schema keyword or construct that was refused. Raised at ``prepare``, before anything is
    saved or sent.
    """

    code = "unsupported_output_type"

    def __init__(self, message: str, *, field_path: str, keyword: str) -> None:
        super().__init__(message)
        self.field_path = field_path
        self.keyword = keyword


class InvalidCredentials(InvalidRequest):
    """An API key or token that cannot be sent in an HTTP header (empty, non-ASCII,
    whitespace or control characters). Raised before any attempt is consumed."""

    code = "invalid_credentials"


class TrioRequired(RecoveryError, RuntimeError):
    """``open_runtime`` was used outside Trio (e.g. under ``asyncio.run`` or in plain code).

    Use ``recoverable.BlockingRuntime`` (threads, blocking code) or
    ``recoverable.AsyncioRuntime`` (asyncio) instead: they run the Trio runtime in
    a thread of their own.
    """

    code = "trio_required"


class RuntimeClosed(RecoveryError):
    """A ``BlockingRuntime``/``AsyncioRuntime`` call came after it closed (or before it opened)."""

    code = "runtime_closed"


class PriceUnknown(InvalidRequest):
    """A cost budget (``maximum_cost_total``, ``--max-cost``) was asked for a model whose
    price is unknown: its cost could not be counted, so nothing was saved or sent (fail
    closed). ``model`` and ``service_tier`` name what has no price."""

    code = "price_unknown"
    _summary = "the model has no known price, so a cost budget cannot be counted"
    _action = (
        "pass prices= (a price table: recoverable.pricing.load_prices) naming the model, "
        "or install recoverable[prices] (genai-prices); nothing was saved or sent"
    )

    def __init__(
        self,
        message: str = "",
        *,
        operation_id: str | None = None,
        model: str | None = None,
        service_tier: str | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id)
        self.model = model
        self.service_tier = service_tier

def _sentence(doc: str) -> str:
    text = doc.rstrip(".").strip()
    return text[:1].lower() + text[1:]


def with_detail(what: str, detail: str) -> str:
    return f"{what} ({detail})" if detail and detail != what else what
