"""``recoverable batch --max-cost``: each job's dollar budget against the embedded fixture
provider, as a real process: it stops a job's replacements at the attempt whose cost
reached it, a rerun sends nothing more, a model without a price refuses the batch before
anything runs, and ``--prices`` takes precedence over genai-prices."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from recoverable.pricing import default_prices

from .cli_helpers import job_line, read_results, run_cli, write_jobs
from .test_batch_usage import summary_rows, tokens

PRICES = {"gpt-test": {"input": 1000.0, "output": 4000.0}}  # USD per 1M tokens


def _attempt_costs(status_text: str) -> list[float]:
    """Each attempt's cost from ``status``' per-attempt tokens, at PRICES."""
    line = next(row for row in status_text.splitlines() if row.startswith("tokens per attempt"))
    pairs = re.findall(r"(\d+) in / (\d+) out", line)
    return [(int(inp) * 1000.0 + int(out) * 4000.0) / 1e6 for inp, out in pairs]


def test_max_cost_stops_each_job_at_the_attempt_whose_cost_reached_it(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    out, errors_file = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    # Every attempt fails with response.failed (replaced: server_error), which reports the
    # input it processed; 0.2 USD is reached by the third attempt (about 0.077 each).
    args = ("batch", str(jobs), "--out", str(out), "--faults", "failed=1.0",
            "--max-attempts", "8", "--backoff", "0.01", "--prices", str(prices),
            "--max-cost", "0.2", "--errors", str(errors_file))
    proc = run_cli(*args)
    assert proc.returncode == 1, proc.stderr
    rows = summary_rows(proc.stdout)
    assert rows["POSTs (attempts spent)"] == "9"
    assert "cost_budget_exhausted:provider_failed" in proc.stdout
    failures = [json.loads(line) for line in errors_file.read_text().splitlines()]
    assert [line["code"] for line in failures] == ["cost_budget_exhausted"] * 3
    assert read_results(out) == []
    for failure in failures:
        status = run_cli("status", "--store", str(out) + ".store", "--account", "batch",
                         failure["operation_id"])
        assert status.returncode == 0, status.stderr
        costs = _attempt_costs(status.stdout)
        # Stopped right after the first attempt whose running total reached 0.2 USD.
        assert len(costs) == 3 and sum(costs[:2]) < 0.2 <= sum(costs), costs
        assert "availability        exhausted" in status.stdout
        assert re.search(r"cost budget\s+\$0\.2\d+ of \$0\.2 spent", status.stdout)
    inp, _ = tokens(rows, "tokens input")
    assert inp > 0
    # A rerun adopts the failed operations: nothing more is sent, the same failures.
    again = run_cli(*args)
    assert again.returncode == 1, again.stderr
    assert summary_rows(again.stdout)["POSTs (attempts spent)"] == "0"
    assert "cost_budget_exhausted:provider_failed" in again.stdout


def test_max_cost_without_a_price_is_refused_before_anything_runs(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0), job_line(1)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--max-cost", "1")
    assert proc.returncode == 2, proc.stderr
    assert "--max-cost: no price for model 'gpt-test'" in proc.stderr
    assert "--prices FILE" in proc.stderr
    assert not out.exists() and not (tmp_path / "out.jsonl.store").exists()
    for bad in ("0", "-1", "nan", "inf", "x"):
        refused = run_cli("batch", str(jobs), "--out", str(out), "--max-cost", bad)
        assert refused.returncode == 2 and "--max-cost" in refused.stderr, bad


def test_a_price_file_takes_precedence_over_genai_prices(tmp_path: Path) -> None:
    """gpt-4o-mini has a genai-prices price; the file's (far higher) one is the one used,
    by the estimate and by the budget: at genai-prices' price 0.01 USD would allow all 8
    attempts (about 0.00002 USD each), at the file's the first attempt reaches it."""
    genai = default_prices().for_model("gpt-4o-mini")
    assert genai is not None and genai.input < 1.0
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0, model="gpt-4o-mini")])
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"gpt-4o-mini": {"input": 1000.0, "output": 4000.0}}))
    out, errors_file = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--prices", str(prices),
                   "--faults", "failed=1.0", "--max-attempts", "8", "--backoff", "0.01",
                   "--max-cost", "0.01", "--errors", str(errors_file))
    assert proc.returncode == 1, proc.stderr
    rows = summary_rows(proc.stdout)
    assert rows["POSTs (attempts spent)"] == "1"
    (failure,) = [json.loads(line) for line in errors_file.read_text().splitlines()]
    assert failure["code"] == "cost_budget_exhausted"
    inp, _ = tokens(rows, "tokens input")
    outp, _ = tokens(rows, "tokens output")
    cost = re.match(r"\$(\d+\.\d{4})", rows["estimated cost"])
    assert cost is not None
    assert float(cost.group(1)) == pytest.approx((inp * 1000.0 + outp * 4000.0) / 1e6, abs=1e-4)
    assert rows["prices"] == f"{prices} (genai-prices for other models)"
    # Without the file, genai-prices' price: the attempt budget ends the job instead.
    plain = run_cli("batch", str(jobs), "--out", str(tmp_path / "plain.jsonl"),
                    "--faults", "failed=1.0", "--max-attempts", "8", "--backoff", "0.01",
                    "--max-cost", "0.01")
    assert plain.returncode == 1, plain.stderr
    assert summary_rows(plain.stdout)["POSTs (attempts spent)"] == "8"
    assert summary_rows(plain.stdout)["prices"].startswith("genai-prices ")
