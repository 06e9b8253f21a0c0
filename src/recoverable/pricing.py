"""Token totals and an estimated cost for ``recoverable batch``.

The ledger sums the usage the provider reported per attempt (``AttemptRecord.usage``)
by model, and separately the attempts that did not produce the result (replaced
attempts and failed jobs' attempts): what replacements cost.

Prices are per one million tokens, per model: ``input``, ``cached_input`` (defaults to
``input``) and ``output`` (reasoning tokens are output tokens). A price file
(``--prices FILE``) is a JSON object::

    {"gpt-4o-mini": {"input": 0.15, "cached_input": 0.075, "output": 0.60}}

A UTF-8 byte order mark at its start is skipped. A model (or a model's field) named twice
is refused, naming it (a JSON decoder would silently keep the last one), and so is a
``cached_input`` above ``input`` (a cached token never costs more than an uncached one).

Without one, a tiny built-in table of a few public list prices is used. It is an
ESTIMATE, dated, and goes stale: the provider's price page (and your contract, tier,
batch or flex discounts) is the truth. A model with no price shows as such, never as 0.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import attrs
import msgspec

from recoverable import errors
from recoverable.outcome import Usage
from recoverable.records import OperationRecord

__all__ = [
    "BUILTIN_PRICES",
    "BUILTIN_PRICES_AS_OF",
    "ModelPrice",
    "PriceTable",
    "TokenLedger",
    "attempts_usage_text",
    "builtin_prices",
    "load_prices",
    "usage_text",
]

MAX_PRICE_FILE_BYTES: Final = 1 << 20
MAX_MODELS: Final = 1000
MAX_MODEL_CHARS: Final = 256
MAX_PRICE_PER_MILLION: Final = 1_000_000.0
UTF8_BOM: Final = b"\xef\xbb\xbf"

# Public list prices in USD per 1M tokens, standard tier, as published by the provider
# on the date below. An estimate only: check the provider's pricing page.
BUILTIN_PRICES_AS_OF: Final = "2025-08-07"
BUILTIN_PRICES: Final[Mapping[str, tuple[float, float, float]]] = {
    # model: (input, cached input, output)
    "gpt-4o-mini": (0.15, 0.075, 0.60),
    "gpt-4.1-mini": (0.40, 0.10, 1.60),
    "gpt-5-mini": (0.25, 0.025, 2.00),
    "gpt-5": (1.25, 0.125, 10.00),
}

_SNAPSHOT: Final = re.compile(r"-\d{4}-\d{2}-\d{2}$")  # "gpt-4o-mini-2024-07-18"


@attrs.frozen
class ModelPrice:
    """USD per one million tokens."""

    input: float
    cached_input: float
    output: float

    def cost(self, usage: Usage) -> float:
        uncached = max(0, usage.input_tokens - usage.cached_input_tokens)
        return (
            uncached * self.input
            + usage.cached_input_tokens * self.cached_input
            + usage.output_tokens * self.output
        ) / 1_000_000


@attrs.frozen
class PriceTable:
    prices: Mapping[str, ModelPrice]
    source: str  # shown in the summary: the file, or the dated built-in table

    def for_model(self, model: str) -> ModelPrice | None:
        """The exact model's price, else its undated name's (a dated snapshot)."""
        found = self.prices.get(model)
        if found is None:
            found = self.prices.get(_SNAPSHOT.sub("", model))
        return found


def builtin_prices() -> PriceTable:
    return PriceTable(
        {model: ModelPrice(*price) for model, price in BUILTIN_PRICES.items()},
        source=f"built-in estimate, prices as of {BUILTIN_PRICES_AS_OF}, check the provider",
    )


class _PriceLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input: float
    output: float
    cached_input: float | None = None


def load_prices(path: str) -> PriceTable:
    """Read a price file; ``InvalidRequest`` (naming the model and field) when it is wrong.

    The built-in prices of models the file does not name are kept, so a file only needs
    the models it corrects or adds."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PRICE_FILE_BYTES + 1)
    except OSError as exc:
        raise errors.InvalidRequest(f"cannot read the price file: {exc.strerror}") from None
    if len(data) > MAX_PRICE_FILE_BYTES:
        raise errors.InvalidRequest(f"the price file is larger than {MAX_PRICE_FILE_BYTES} bytes")
    # A UTF-8 byte order mark (as some editors save JSON) is accepted and skipped.
    data = data.removeprefix(UTF8_BOM)
    repeated = _repeated_key(data)
    if repeated is not None:
        raise errors.InvalidRequest(
            f"price file: {repeated} is given twice (which one is meant? name it once)"
        )
    try:
        raw = msgspec.json.decode(data, type=dict[str, _PriceLine])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.InvalidRequest(
            "the price file must be a JSON object: model -> {input, cached_input, output} "
            f"(USD per 1M tokens): {exc}"
        ) from None
    if len(raw) > MAX_MODELS:
        raise errors.InvalidRequest(f"the price file names more than {MAX_MODELS} models")
    prices = dict(builtin_prices().prices)
    for model, line in raw.items():
        if not model or len(model) > MAX_MODEL_CHARS or any(ord(char) < 32 for char in model):
            raise errors.InvalidRequest(
                f"price file: model names must be 1..{MAX_MODEL_CHARS} printable characters"
            )
        cached = line.input if line.cached_input is None else line.cached_input
        for field, value in (("input", line.input), ("cached_input", cached),
                             ("output", line.output)):
            if not math.isfinite(value) or not 0 <= value <= MAX_PRICE_PER_MILLION:
                raise errors.InvalidRequest(
                    f"price file: {model}.{field} must be a number in 0..{MAX_PRICE_PER_MILLION:g}"
                )
        if cached > line.input:
            raise errors.InvalidRequest(
                f"price file: {model}.cached_input ({cached:g}) is above {model}.input "
                f"({line.input:g}): a cached input token never costs more than an uncached one"
            )
        prices[model] = ModelPrice(line.input, cached, line.output)
    return PriceTable(prices, source=f"{path} (built-in estimate for other models)")


class _Object(list[tuple[str, Any]]):
    """A JSON object as its key-value pairs, in order, repeats kept."""


def _repeats(pairs: _Object) -> Iterator[str]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            yield key
        seen.add(key)


def _repeated_key(data: bytes) -> str | None:
    """The first name given twice in the price file: ``model 'm'`` or ``'f' of model 'm'``
    (None: none, or the file is not JSON, which the typed decode reports). A JSON decoder
    keeps the last of two equal keys without a word: one of two prices would be dropped."""
    try:
        tree = json.loads(data.decode("utf-8"), object_pairs_hook=_Object)
    except (ValueError, RecursionError):
        return None
    if not isinstance(tree, _Object):
        return None
    for model in _repeats(tree):
        return f"model {model[:64]!r}"
    for model, line in tree:
        if isinstance(line, _Object):
            for field in _repeats(line):
                return f"{field[:64]!r} of model {model[:64]!r}"
    return None


@attrs.define
class _ModelTokens:
    total: Usage = attrs.field(factory=Usage)
    replaced: Usage = attrs.field(factory=Usage)  # attempts that did not produce the result


@attrs.define
class TokenLedger:
    """Token totals by model over the operations a batch run finished."""

    by_model: dict[str, _ModelTokens] = attrs.field(factory=dict)
    attempts_without_usage: int = 0  # spent attempts the provider reported nothing for

    def add(self, record: OperationRecord) -> None:
        tokens = self.by_model.setdefault(record.model, _ModelTokens())
        for attempt in record.attempts:
            if attempt.usage is None:
                self.attempts_without_usage += 1
                continue
            tokens.total = tokens.total + attempt.usage
            if attempt.outcome != "completed":
                tokens.replaced = tokens.replaced + attempt.usage

    @property
    def total(self) -> Usage:
        return _sum(tokens.total for tokens in self.by_model.values())

    @property
    def replaced(self) -> Usage:
        return _sum(tokens.replaced for tokens in self.by_model.values())

    def rows(self, prices: PriceTable | None) -> list[tuple[str, str]]:
        """The summary rows: tokens, and the estimated cost when every model has a price."""
        total, replaced = self.total, self.replaced
        rows = [
            ("tokens input", f"{total.input_tokens} (cached {total.cached_input_tokens})"),
            ("tokens output", f"{total.output_tokens} (reasoning {total.reasoning_tokens})"),
            ("tokens total", str(total.total_tokens)),
            ("tokens without a result", f"{replaced.total_tokens} (replaced or failed attempts)"),
        ]
        if self.attempts_without_usage:
            rows.append(("attempts without usage", f"{self.attempts_without_usage} "
                         "(cut before the provider reported tokens; not counted)"))
        if prices is None or not self.by_model:
            return rows
        cost = replaced_cost = 0.0
        unpriced: list[str] = []
        for model, tokens in sorted(self.by_model.items()):
            price = prices.for_model(model)
            if price is None:
                if tokens.total != Usage():
                    unpriced.append(model)
                continue
            cost += price.cost(tokens.total)
            replaced_cost += price.cost(tokens.replaced)
        if unpriced:
            names = ", ".join(unpriced[:5]) + (" ..." if len(unpriced) > 5 else "")
            rows.append(("estimated cost", f"unknown: no price for {names} (pass --prices FILE)"))
        else:
            rows.append((
                "estimated cost", f"${cost:.4f} (of which without a result ${replaced_cost:.4f})"
            ))
        rows.append(("prices", prices.source))
        return rows


def usage_text(usage: Usage | None) -> str | None:
    """One line for a person: ``None`` when nothing was reported."""
    if usage is None or usage == Usage():
        return None
    return (
        f"{usage.input_tokens} input (cached {usage.cached_input_tokens}), "
        f"{usage.output_tokens} output (reasoning {usage.reasoning_tokens})"
    )


def attempts_usage_text(usages: Iterable[tuple[int, Usage | None]]) -> str | None:
    """Per attempt: ``1: -; 2: 120 in / 30 out`` (``None`` when no attempt reported any)."""
    pairs = list(usages)
    if all(usage is None for _, usage in pairs):
        return None
    return "; ".join(
        f"{number}: "
        + ("-" if usage is None else f"{usage.input_tokens} in / {usage.output_tokens} out")
        for number, usage in pairs
    )


def _sum(usages: Iterable[Usage]) -> Usage:
    total = Usage()
    for usage in usages:
        total = total + usage
    return total
