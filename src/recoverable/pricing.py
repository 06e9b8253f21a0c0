"""Token totals and an estimated cost for ``recoverable batch``, and the prices a cost
budget (``maximum_cost_total``) is counted with.

The ledger sums the usage the provider reported per attempt (``AttemptRecord.usage``)
by model and service tier, and separately the attempts that did not produce the result
(replaced attempts and failed jobs' attempts): what replacements cost.

Prices are USD per one million tokens, per model: ``input``, ``cached_input`` (defaults to
``input``) and ``output`` (reasoning tokens are output tokens). They come from, first to
last:

1. a price file (``--prices FILE``), a JSON object::

       {"gpt-4o-mini": {"input": 0.15, "cached_input": 0.075, "output": 0.60}}

   A UTF-8 byte order mark at its start is skipped. A model (or a model's field) named
   twice is refused, naming it (a JSON decoder would silently keep the last one), and so
   is a ``cached_input`` above ``input`` (a cached token never costs more than an
   uncached one). A file's price is the same for every service tier.
2. the maintained ``genai-prices`` package (the ``prices`` extra: it brings pydantic,
   which the core never needs), provider ``openai``, with the service tier of the
   request (``flex``, ``priority``, ...; ``auto`` and none are the default tier's; a
   tier it lists no price for is unknown, never the default tier's).
   Models priced by prompt size (a long-context rate) are given their highest rate: an
   upper bound, so a budget stops early rather than late.
3. nothing: without ``genai-prices`` and a file, prices are unknown and shown as such,
   never as 0, and a cost budget is refused (``PriceUnknown``) before anything is sent.

Any price is an ESTIMATE: the provider's invoice (and your contract) is the truth.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import attrs
import msgspec

from recoverable import errors
from recoverable.outcome import ModelPrice, Usage
from recoverable.records import OperationRecord

__all__ = [
    "CostBudget",
    "ModelPrice",
    "PriceTable",
    "TokenLedger",
    "attempts_usage_text",
    "cost_budget",
    "default_prices",
    "load_prices",
    "successor_cost",
    "usage_text",
]

MAX_PRICE_FILE_BYTES: Final = 1 << 20
MAX_MODELS: Final = 1000
MAX_MODEL_CHARS: Final = 256
MAX_PRICE_PER_MILLION: Final = 1_000_000.0
UTF8_BOM: Final = b"\xef\xbb\xbf"

_SNAPSHOT: Final = re.compile(r"-\d{4}-\d{2}-\d{2}$")  # "gpt-4o-mini-2024-07-18"
# Tiers that are the default tier's prices (``auto``: the project's default, as billed
# unless the project chose another).
_DEFAULT_TIERS: Final = frozenset({None, "auto", "default"})
PriceLookup = Callable[[str, str | None], ModelPrice | None]


@attrs.frozen
class PriceTable:
    """Prices by model: a price file's first, then ``lookup`` (``genai-prices``), if any."""

    prices: Mapping[str, ModelPrice]
    source: str  # shown in the summary: where the prices come from
    lookup: PriceLookup | None = None

    def for_model(self, model: str, service_tier: str | None = None) -> ModelPrice | None:
        """The exact model's price, else its undated name's (a dated snapshot), else the
        lookup's for that service tier; None when nobody knows it."""
        found = self.prices.get(model)
        if found is None:
            found = self.prices.get(_SNAPSHOT.sub("", model))
        if found is None and self.lookup is not None:
            found = self.lookup(model, service_tier)
        return found


def _highest(price: Any) -> float | None:
    """A genai-prices price as one number: a prompt-size tiered price is its highest rate."""
    if price is None:
        return None
    tiers = getattr(price, "tiers", None)
    if tiers is None:
        return float(price)
    return float(max([price.base, *(tier.price for tier in tiers)]))


@functools.lru_cache(maxsize=1024)  # the dashboard prices every attempt of every record
def _genai_price(model: str, service_tier: str | None) -> ModelPrice | None:
    """``genai-prices``' price of an OpenAI model at a service tier (None: not known)."""
    from genai_prices import data_snapshot  # the prices extra: imported when first used

    try:
        _, info = data_snapshot.get_snapshot().find_provider_model(model, None, "openai", None)
    except LookupError:
        return None
    context = None if service_tier in _DEFAULT_TIERS else {"service_tier": str(service_tier)}
    if context is not None and not any(
        variant.when == context for variant in info.price_variants or ()
    ):
        # genai-prices would fall back to the default tier's price: for a tier it does not
        # list (``scale``, or ``flex`` of a model without one) that may be too low.
        return None
    listed = info.get_prices(datetime.now(tz=UTC), context)
    uncached = _highest(listed.input_mtok)
    output = _highest(listed.output_mtok)
    if uncached is None or output is None:
        return None
    cached = _highest(listed.cache_read_mtok)
    return ModelPrice(uncached, uncached if cached is None else min(cached, uncached), output)


def _genai_prices_version() -> str | None:
    try:
        import genai_prices
    except ImportError:
        return None
    return str(genai_prices.__version__)


NO_PRICES: Final = (
    "unknown: genai-prices is not installed (pip install 'recoverable[prices]'), "
    "or pass --prices FILE"
)


def default_prices() -> PriceTable:
    """``genai-prices``' table when the package is installed, else an empty one that says
    prices are unknown and why."""
    version = _genai_prices_version()
    if version is None:
        return PriceTable({}, source=NO_PRICES)
    return PriceTable(
        {}, source=f"genai-prices {version} (an estimate: check the provider)",
        lookup=_genai_price,
    )


@attrs.frozen
class CostBudget:
    """A cost budget as an operation saves it: USD, and the price it is counted at."""

    maximum: float
    price: ModelPrice


def cost_budget(
    maximum: float | None, model: str, service_tier: str | None, prices: PriceTable | None
) -> CostBudget | None:
    """The budget a new operation saves (None: none asked). Fail closed: ``PriceUnknown``
    when ``prices`` (else ``default_prices()``) has no price for the model and tier."""
    if maximum is None:
        return None
    table = default_prices() if prices is None else prices
    price = table.for_model(model, service_tier)
    if price is None:
        at = "" if service_tier is None else f" at service tier {service_tier!r}"
        raise errors.PriceUnknown(
            f"no price for model {model[:MAX_MODEL_CHARS]!r}{at} (prices: {table.source}): "
            "a cost budget (maximum_cost_total) cannot be counted without one",
            model=model, service_tier=service_tier,
        )
    return CostBudget(float(maximum), price)


def successor_cost(source: OperationRecord, model: str) -> CostBudget | None:
    """A successor's cost budget: its source's, counted afresh; at the source's frozen
    price for the same model, else at the default price of the new one (fail closed)."""
    limit = source.maximum_cost_total
    if limit is None:
        return None
    if model == source.model and source.cost_price is not None:
        return CostBudget(limit, source.cost_price)
    return cost_budget(limit, model, source.service_tier, None)


class _PriceLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input: float
    output: float
    cached_input: float | None = None


def load_prices(path: str) -> PriceTable:
    """Read a price file; ``InvalidRequest`` (naming the model and field) when it is wrong.

    Models the file does not name keep ``default_prices()``' price (genai-prices), so a
    file only needs the models it corrects or adds: for those it takes precedence."""
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
    prices: dict[str, ModelPrice] = {}
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
    fallback = default_prices()
    other = "genai-prices" if fallback.lookup is not None else "no price"
    return PriceTable(prices, source=f"{path} ({other} for other models)",
                      lookup=fallback.lookup)


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
    """Token totals by model and service tier over the operations a batch run finished."""

    by_model: dict[tuple[str, str | None], _ModelTokens] = attrs.field(factory=dict)
    attempts_without_usage: int = 0  # spent attempts the provider reported nothing for

    def add(self, record: OperationRecord) -> None:
        key = (record.model, record.service_tier)
        tokens = self.by_model.setdefault(key, _ModelTokens())
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
        for (model, tier), tokens in sorted(self.by_model.items(), key=_model_order):
            price = prices.for_model(model, tier)
            if price is None:
                if tokens.total != Usage() and model not in unpriced:
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


def _model_order(item: tuple[tuple[str, str | None], Any]) -> tuple[str, str]:
    (model, tier), _ = item
    return model, tier or ""


def _sum(usages: Iterable[Usage]) -> Usage:
    total = Usage()
    for usage in usages:
        total = total + usage
    return total
