"""``recoverable batch`` prints the tokens it used and, with prices, the estimated cost
including what replacements cost (issue 19.3) — as a real process against the fixture."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import msgspec
import pytest

import recoverable

from .cli_helpers import job_line, read_results, run_cli, write_jobs

PRICES = {"gpt-test": {"input": 1000.0, "cached_input": 500.0, "output": 4000.0}}


def summary_rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def tokens(rows: dict[str, str], key: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+) \((?:cached|reasoning) (\d+)\)", rows[key])
    assert m, rows[key]
    return int(m.group(1)), int(m.group(2))


def test_summary_shows_tokens_and_the_cost_of_replacements_with_a_price_file(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(12)])
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(PRICES))
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        "batch", str(jobs), "--out", str(out), "--backoff", "0.01", "--max-attempts", "8",
        "--faults", "failed=0.4,disconnect=0.2,seed=11", "--prices", str(prices),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(read_results(out)) == 12
    rows = summary_rows(proc.stdout)
    inp, cached = tokens(rows, "tokens input")
    outp, reasoning = tokens(rows, "tokens output")
    assert inp > 0 and outp > 0 and cached == 0 and reasoning == 0
    assert rows["tokens total"] == str(inp + outp)
    # response.failed reports the input it processed: replacements cost something.
    wasted = int(rows["tokens without a result"].split()[0])
    assert wasted > 0
    m = re.fullmatch(r"\$(\d+\.\d{4}) \(of which without a result \$(\d+\.\d{4})\)",
                     rows["estimated cost"])
    assert m, rows["estimated cost"]
    assert float(m.group(1)) == pytest.approx((inp * 1000.0 + outp * 4000.0) / 1e6, abs=1e-4)
    assert 0 < float(m.group(2)) < float(m.group(1))
    assert rows["prices"].startswith(str(prices))
    assert int(rows["attempts without usage"].split()[0]) > 0  # the disconnects


def test_without_faults_nothing_is_wasted_and_an_unknown_model_has_no_price(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = summary_rows(proc.stdout)
    assert rows["tokens without a result"].startswith("0 ")
    assert "attempts without usage" not in rows
    # gpt-test is in no price table: the cost is unknown, never $0.
    assert rows["estimated cost"].startswith("unknown: no price for gpt-test")
    assert rows["prices"].startswith("genai-prices ")  # the prices extra (dev installs it)
    assert "check the provider" in rows["prices"]


def test_genai_prices_price_a_known_model(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0, model="gpt-4o-mini")])
    proc = run_cli("batch", str(jobs), "--out", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 0, proc.stderr
    rows = summary_rows(proc.stdout)
    assert rows["estimated cost"].startswith("$")
    assert "genai-prices" in rows["prices"]


@pytest.mark.parametrize(
    "content,needle",
    [
        ("not json", "JSON object"),
        (json.dumps({"m": {"input": -1, "output": 1}}), "m.input"),
        (json.dumps({"m": {"input": 1, "output": 1, "bogus": 2}}), "bogus"),
        (json.dumps({"m": {"input": 1}}), "output"),
        (json.dumps({"m": {"input": 1, "output": 2e6}}), "m.output"),
        ('{"m": {"input": 1, "output": 1e999}}', "--prices"),
    ],
)
def test_a_bad_price_file_is_a_usage_error_before_anything_runs(
    tmp_path: Path, content: str, needle: str
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    prices = tmp_path / "prices.json"
    prices.write_text(content)
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--prices", str(prices))
    assert proc.returncode == 2
    assert "--prices" in proc.stderr and needle in proc.stderr
    assert not out.exists() and not Path(str(out) + ".store").exists()


def test_a_missing_price_file_is_a_usage_error(tmp_path: Path) -> None:
    # Once, not in every case above: it reads no content, so the content never mattered.
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0)])
    out = tmp_path / "out.jsonl"
    missing = run_cli("batch", str(jobs), "--out", str(out), "--prices", str(tmp_path / "no"))
    assert missing.returncode == 2 and "cannot read the price file" in missing.stderr


def test_status_and_receipt_commands_show_the_tokens(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    out = tmp_path / "out.jsonl"
    s = str(store_dir)
    # An invalid answer still consumed tokens: saved on the failed attempt.
    failing = write_jobs(tmp_path / "failing.jsonl", [job_line(1)])
    run = run_cli("batch", str(failing), "--out", str(out), "--store", s,
                  "--faults", "schema_violation=1.0")
    assert run.returncode == 1
    # Killed right after the receipt was saved: completed, not acknowledged.
    saved = write_jobs(tmp_path / "saved.jsonl", [job_line(2)])
    killed = run_cli("batch", str(saved), "--out", str(out), "--store", s,
                     env={"RECOVERABLE_KILL_AT": "receipt.saved"})
    assert killed.returncode == -signal.SIGKILL
    inventory = msgspec.json.decode(
        run_cli("inventory", "--store", s, "--account", "batch", "--json").stdout,
        type=recoverable.Inventory,
    )
    by_job = {st.job_id: st for st in inventory.operations}
    failed, done = by_job["gen-0001"], by_job["gen-0002"]
    assert failed.attempts[0].usage is not None and failed.usage.output_tokens > 0
    assert done.usage.input_tokens > 0
    human = run_cli("status", "--store", s, "--account", "batch", failed.operation_id)
    assert human.returncode == 0, human.stderr
    rows = summary_rows(human.stdout)
    assert rows["tokens"] == (
        f"{failed.usage.input_tokens} input (cached 0), "
        f"{failed.usage.output_tokens} output (reasoning 0)"
    )
    assert rows["tokens per attempt"].startswith("1: ")
    receipt = msgspec.json.decode(
        run_cli("receipt", "--store", s, "--account", "batch", done.operation_id,
                "--json").stdout.encode(),
        type=dict,
    )
    assert receipt["usage"]["input_tokens"] == done.usage.input_tokens
    text = run_cli("receipt", "--store", s, "--account", "batch", done.operation_id)
    assert summary_rows(text.stdout)["tokens"].startswith(f"{done.usage.input_tokens} input")
