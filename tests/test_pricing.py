"""Where prices come from: a --prices file first, then genai-prices (service-tier aware),
else nothing (said so); and the cost budget's fail-closed price lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recoverable import errors, pricing
from recoverable.outcome import ModelPrice, Usage
from recoverable.pricing import PriceTable, cost_budget, default_prices, load_prices


def test_genai_prices_gives_openai_prices_by_service_tier() -> None:
    table = default_prices()
    assert table.source.startswith("genai-prices ") and "check the provider" in table.source
    standard = table.for_model("gpt-4o-mini")
    assert standard is not None and standard.input > 0 and standard.output > standard.input
    assert standard.cached_input <= standard.input
    # A dated snapshot name is the model's; "auto" and "default" are the default tier's.
    assert table.for_model("gpt-4o-mini-2024-07-18") == standard
    assert table.for_model("gpt-4o-mini", "auto") == standard
    assert table.for_model("gpt-4o-mini", "default") == standard
    five = table.for_model("gpt-5-mini")
    flex, priority = table.for_model("gpt-5-mini", "flex"), table.for_model("gpt-5-mini",
                                                                              "priority")
    assert five is not None and flex is not None and priority is not None
    assert flex.input < five.input < priority.input  # the tier changes the price
    # A tier genai-prices lists no price for is unknown, not the default tier's.
    assert table.for_model("gpt-5-mini", "scale") is None
    assert table.for_model("gpt-4o-mini", "flex") is None
    assert table.for_model("gpt-test") is None  # the fixture's made-up model


def test_a_price_file_takes_precedence_over_genai_prices(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"gpt-4o-mini": {"input": 7.0, "output": 9.0},
                                "my-finetune": {"input": 3.0, "output": 12.0}}))
    table = load_prices(str(path))
    assert table.for_model("gpt-4o-mini") == ModelPrice(7.0, 7.0, 9.0)
    assert table.for_model("gpt-4o-mini", "flex") == ModelPrice(7.0, 7.0, 9.0)  # any tier
    assert table.for_model("my-finetune") == ModelPrice(3.0, 3.0, 12.0)
    # Models the file does not name keep genai-prices' price.
    assert table.for_model("gpt-5-mini") == default_prices().for_model("gpt-5-mini")
    assert table.source == f"{path} (genai-prices for other models)"
    budget = cost_budget(1.0, "gpt-4o-mini", None, table)
    assert budget is not None and budget.price == ModelPrice(7.0, 7.0, 9.0)


def test_without_genai_prices_prices_are_unknown_and_a_budget_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pricing, "_genai_prices_version", lambda: None)
    table = default_prices()
    assert table.lookup is None and table.for_model("gpt-4o-mini") is None
    assert table.source.startswith("unknown: genai-prices is not installed")
    assert "recoverable[prices]" in table.source and "--prices FILE" in table.source
    with pytest.raises(errors.PriceUnknown) as caught:
        cost_budget(1.0, "gpt-4o-mini", "flex", None)
    assert caught.value.model == "gpt-4o-mini" and caught.value.service_tier == "flex"
    assert "not installed" in str(caught.value)
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"gpt-4o-mini": {"input": 1.0, "output": 2.0}}))
    with_file = load_prices(str(path))
    assert with_file.for_model("gpt-4o-mini") == ModelPrice(1.0, 1.0, 2.0)
    assert with_file.for_model("gpt-5") is None
    assert with_file.source == f"{path} (no price for other models)"


def test_no_budget_needs_no_price_and_the_cost_counts_cached_tokens_at_their_price() -> None:
    assert cost_budget(None, "gpt-test", None, PriceTable({}, source="empty")) is None
    price = ModelPrice(1000.0, 500.0, 4000.0)
    usage = Usage(input_tokens=100, cached_input_tokens=40, output_tokens=10)
    assert price.cost(usage) == pytest.approx((60 * 1000 + 40 * 500 + 10 * 4000) / 1e6)


def test_a_long_context_rate_is_taken_as_the_price() -> None:
    """A model priced by prompt size is given its highest rate (an upper bound)."""
    long_context = default_prices().for_model("gpt-5.4")
    assert long_context is not None and long_context.input >= 2.5
