"""Issue 28: the input-validation defects an adversarial probe found, as one table per area.

Bad input gets a clear, typed error and loses nothing; one bad job line never stops the
batch. Each row names its input and its outcome: refused with a message fragment, or
accepted (the ``control-*`` rows: what the new rules must keep accepting). The CLI runs
in-process (``recoverable.cli.main``) where the defect is the CLI's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import recoverable
from recoverable import errors
from recoverable.actors.governor import DEFAULT_BURST_SECONDS
from recoverable.cli import main
from recoverable.cli.arguments import build_parser
from recoverable.cli.entry import _batch_config
from recoverable.cli.formatting import format_inventory, format_receipt, format_status, safe_text
from recoverable.cli.jobs import read_jobs
from recoverable.cli.worker import worker_config
from recoverable.pricing import load_prices
from recoverable.storage.queue import (
    WorkerRow,
    encode_member,
    encode_worker,
    member_key,
    order_key,
)
from recoverable.types import AccountBinding, Inventory, Receipt, SourceRef, Status

from .cli_helpers import SMALL_SCHEMA, job_line, write_jobs

pytestmark = pytest.mark.both_stores  # the queue rows: one table, both stores

# What must never reach a terminal raw (this test's own oracle): C0 controls, DEL, C1
# controls, the bidirectional embeddings, overrides and isolates, lone surrogates.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")

# -- 1, 2: job lines (OpenAI Batch API lines and this tool's own) ---------------------------


def batch_line(custom_id: str = "req-1", **body_changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gpt-test",
        "input": "Great battery.",
        "temperature": 0.5,
        "text": {"format": {"type": "json_schema", "name": "label", "schema": SMALL_SCHEMA,
                            "strict": True}},
    }
    body.update(body_changes)
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def _without_input() -> dict[str, Any]:
    line = batch_line()
    del line["body"]["input"]
    return line


def _temperature(literal: str, line: dict[str, Any] | None = None) -> str:
    """The line as JSON with its temperature written as ``literal`` (not JSON numbers)."""
    text = json.dumps(line or batch_line())
    assert '"temperature": 0.5' in text
    return text.replace('"temperature": 0.5', f'"temperature": {literal}')


def _messages(*roles: Any, **item: Any) -> list[dict[str, Any]]:
    return [{"role": role, "content": "Great battery.", **item} for role in roles]


ID_RULE = "must be 1..256 characters without control characters, DEL or bidirectional"
NOT_FINITE = "not valid JSON for the API"


class LineCase(NamedTuple):
    name: str
    line: dict[str, Any] | str
    refused: tuple[str, ...] | None  # fragments of the reason; None: accepted


LINE_CASES = [
    # Batch API lines
    LineCase("batch-without-input", _without_input(), ("body.input is missing",)),
    LineCase("batch-role-wizard", batch_line(input=_messages("wizard")),
             ("input item 0 has role 'wizard'", "assistant, developer, system, user")),
    LineCase("batch-message-without-role", batch_line(input=[{"type": "message",
                                                              "content": "x"}]),
             ("input item 0 has no role",)),
    LineCase("batch-role-not-a-string", batch_line(input=_messages(7)), ("has role int",)),
    LineCase("batch-custom-id-del", batch_line("req\x7f1"), ("custom_id " + ID_RULE, "U+007F")),
    LineCase("batch-custom-id-rlo", batch_line("req\u202e1"), ("custom_id " + ID_RULE, "U+202E")),
    LineCase("batch-custom-id-lre", batch_line("req\u202a1"), ("custom_id " + ID_RULE, "U+202A")),
    LineCase("batch-custom-id-lri", batch_line("req\u20661"), ("custom_id " + ID_RULE, "U+2066")),
    LineCase("batch-custom-id-pdi", batch_line("req\u20691"), ("custom_id " + ID_RULE, "U+2069")),
    LineCase("batch-custom-id-c1-csi", batch_line("req\x9b1"), ("custom_id " + ID_RULE, "U+009B")),
    LineCase("batch-nan", _temperature("NaN"), (NOT_FINITE, "NaN", "not a JSON number")),
    LineCase("batch-minus-infinity", _temperature("-Infinity"), (NOT_FINITE, "-Infinity")),
    LineCase("batch-1e999", _temperature("1e999"), (NOT_FINITE, "out of range", "1e999")),
    LineCase("control-batch-roles", batch_line(
        input=_messages("developer", "system", "user", "assistant")), None),
    LineCase("control-batch-unicode-custom-id", batch_line("résumé-日本語-\u0661"), None),
    # this tool's own job lines: the same rule for id and revision
    LineCase("own-id-del", job_line(1) | {"id": "gen\x7f1"}, ("id " + ID_RULE, "U+007F")),
    LineCase("own-id-rlo", job_line(1) | {"id": "gen\u202e1"}, ("id " + ID_RULE, "U+202E")),
    LineCase("own-revision-lre", job_line(1, revision="r\u202a1"),
             ("revision " + ID_RULE, "U+202A")),
    LineCase("own-revision-fsi", job_line(1, revision="r\u20681"),
             ("revision " + ID_RULE, "U+2068")),
    LineCase("own-role-wizard", job_line(1, input=_messages("wizard")),
             ("input item 0 has role 'wizard'",)),
    LineCase("own-nan", _temperature("NaN", job_line(1, parameters={"temperature": 0.5})),
             (NOT_FINITE, "NaN")),
    LineCase("own-1e999", _temperature("1e999", job_line(1, parameters={"temperature": 0.5})),
             (NOT_FINITE, "out of range")),
    LineCase("control-own-unicode-id", job_line(1) | {"id": "résumé-日本語"}, None),
]


def _text(line: dict[str, Any] | str) -> str:
    return line if isinstance(line, str) else json.dumps(line)


@pytest.mark.parametrize("case", LINE_CASES, ids=[case.name for case in LINE_CASES])
def test_a_bad_job_line_is_skipped_with_its_reason_and_the_next_line_runs(
    tmp_path: Path, case: LineCase
) -> None:
    good = batch_line("good") if '"custom_id"' in _text(case.line) else job_line(2)
    jobs = read_jobs(str(write_jobs(tmp_path / "jobs.jsonl", [_text(case.line), good])))
    assert [job.lineno for job in jobs.jobs][-1:] == [2]  # the batch goes on
    if case.refused is None:
        assert [job.lineno for job in jobs.jobs] == [1, 2] and jobs.bad_lines == []
        return
    [bad] = jobs.bad_lines
    assert bad.lineno == 1
    for fragment in case.refused:
        assert fragment in bad.reason, bad.reason
    assert "unknown field" not in bad.reason


def test_the_batch_reports_each_bad_batch_api_line_and_runs_the_good_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [case for case in LINE_CASES
             if case.name.startswith("batch-") and case.refused is not None]
    lines = [_text(case.line) for case in cases] + [json.dumps(batch_line("good"))]
    jobs = write_jobs(tmp_path / "jobs.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(jobs), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert UNSAFE.search(err.replace("\n", "")) is None  # nothing raw on a tty
    for number, case in enumerate(cases, start=1):
        [reason] = re.findall(rf"^{re.escape(str(jobs))}:{number}: skipped: (.*)$", err, re.M)
        for fragment in case.refused or ():
            assert fragment in reason, (case.name, reason)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["good"]


# -- 3: --prices FILE ---------------------------------------------------------------------


class PriceCase(NamedTuple):
    name: str
    data: bytes
    refused: str | None  # a fragment of the message; None: accepted (gpt-test: 1, 0.5, 2)


GOOD_PRICE = b'{"gpt-test": {"input": 1, "cached_input": 0.5, "output": 2}}'
PRICE_CASES = [
    PriceCase("bom-is-accepted", b"\xef\xbb\xbf" + GOOD_PRICE, None),
    PriceCase("model-twice", b'{"gpt-test": {"input": 9, "output": 9}, '
              + GOOD_PRICE[1:], "model 'gpt-test' is given twice"),
    PriceCase("field-twice", b'{"gpt-test": {"input": 1, "input": 0.1, "cached_input": 0.5, '
              b'"output": 2}}', "'input' of model 'gpt-test' is given twice"),
    PriceCase("cached-above-input", b'{"gpt-test": {"input": 1, "cached_input": 1.5, '
              b'"output": 2}}', "gpt-test.cached_input (1.5) is above gpt-test.input (1)"),
    PriceCase("control-plain", GOOD_PRICE, None),
]


@pytest.mark.parametrize("case", PRICE_CASES, ids=[case.name for case in PRICE_CASES])
def test_price_files(tmp_path: Path, case: PriceCase) -> None:
    path = tmp_path / "prices.json"
    path.write_bytes(case.data)
    if case.refused is None:
        price = load_prices(str(path)).for_model("gpt-test")
        assert price is not None
        assert (price.input, price.cached_input, price.output) == (1.0, 0.5, 2.0)
        return
    with pytest.raises(errors.InvalidRequest) as caught:
        load_prices(str(path))
    assert case.refused in str(caught.value)


def test_a_refused_price_file_is_a_usage_error_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prices = tmp_path / "prices.json"
    prices.write_bytes(PRICE_CASES[1].data)
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(jobs), "--out", str(out), "--prices", str(prices)]) == 2
    assert "--prices: price file: model 'gpt-test' is given twice" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "out.jsonl.store").exists()


# -- 4: recoverable config set --------------------------------------------------------------


class ConfigCase(NamedTuple):
    name: str
    key: str
    value: str
    refused: str | None


CONFIG_CASES = [
    ConfigCase("budget-arabic-indic", "continuation.budget", "\u0663", "ASCII digits"),
    ConfigCase("budget-fullwidth", "continuation.budget", "\uff13", "ASCII digits"),
    ConfigCase("budget-underscore", "continuation.budget", "1_0", "ASCII digits"),
    ConfigCase("budget-spaces", "continuation.budget", " 3 ", "ASCII digits"),
    ConfigCase("delay-fullwidth", "continuation.delay_seconds", "\uff11\uff12\uff10",
               "plain decimal"),
    ConfigCase("delay-arabic-indic", "continuation.delay_seconds", "\u0661\u0662\u0660",
               "plain decimal"),
    ConfigCase("delay-nan", "continuation.delay_seconds", "nan", "plain decimal"),
    ConfigCase("delay-exponent", "continuation.delay_seconds", "1e3", "plain decimal"),
    ConfigCase("control-budget", "continuation.budget", "3", None),
    ConfigCase("control-delay", "continuation.delay_seconds", "1.5", None),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[case.name for case in CONFIG_CASES])
def test_config_set_takes_ascii_numbers_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: ConfigCase
) -> None:
    store = str(tmp_path / "store")
    recoverable.RecoveryStore.open(store).close()
    code = main(["config", "set", case.key, case.value, "--store", store])
    captured = capsys.readouterr()
    if case.refused is None:
        assert code == 0 and captured.out.startswith(f"{case.key} = "), captured
        return
    assert code == 2 and case.refused in captured.err, captured
    assert main(["config", "get", case.key, "--store", store, "--json"]) == 0
    default = {"continuation.budget": 2, "continuation.delay_seconds": 60.0}[case.key]
    assert json.loads(capsys.readouterr().out)["value"] == default  # nothing changed


# -- 5: stored text shown on a terminal ---------------------------------------------------------

HOSTILE = "\x1b[2J\x1b]0;owned\x07\u202eevil\x9b31m\x7f"


def _assert_escaped(shown: str) -> None:
    assert UNSAFE.search(shown.replace("\n", "")) is None, repr(shown)
    assert "\\x1b[2J" in shown and "\\u202e" in shown


def _status_text() -> str:
    return format_status(Status(
        operation_id="op_1", state="prepared", availability="ready", job_id=HOSTILE,
        input_revision=HOSTILE, source=SourceRef(HOSTILE, HOSTILE),
    ))


def _inventory_text() -> str:
    status = Status(operation_id="op_1", state="prepared", availability="ready",
                    job_id=HOSTILE, input_revision=HOSTILE)
    return format_inventory(Inventory(operations=(status,), unreadable=(HOSTILE,)))


def _receipt_text() -> str:
    import datetime

    return format_receipt(Receipt(
        operation_id="op_1", payload=json.dumps({"label": HOSTILE}).encode(),
        format_name="label", format_hash="h", contract_version=None, job_id=HOSTILE,
        input_revision=None, scope=None,
        completed_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        root_operation_id="op_1", previous_operation_id=None, response_id=None,
        account=AccountBinding("a", "api-key"),
    ))


SHOWN_CASES = {
    "safe-text": lambda: safe_text(HOSTILE),
    "status-source-digest-and-ids": _status_text,
    "inventory-ids-and-unreadable": _inventory_text,
    "receipt-ids-and-result": _receipt_text,
}


@pytest.mark.parametrize("show", SHOWN_CASES.values(), ids=list(SHOWN_CASES))
def test_stored_text_is_escaped_before_it_reaches_a_terminal(show: Any) -> None:
    _assert_escaped(show())


def test_source_set_escapes_a_corrupt_stored_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_dir = str(tmp_path / "store")
    with recoverable.RecoveryStore.open(store_dir) as store:
        store.write_sync(lambda txn: txn.put_raw("sources", b"mdoc", HOSTILE.encode()))
    assert main(["source", "set", "doc", "sha256:bb", "--store", store_dir]) == 0
    shown = capsys.readouterr().out
    # A digest is ASCII: the store reads other bytes back as U+FFFD, escapes stay escapes.
    assert UNSAFE.search(shown.replace("\n", "")) is None, repr(shown)
    assert shown.startswith("source doc: \\x1b[2J\\x1b]0;owned\\x07")
    assert "\\x7f -> sha256:bb; superseded 0" in shown


# -- 6, 7: numeric options -------------------------------------------------------------------


class OptionCase(NamedTuple):
    name: str
    args: tuple[tuple[str, ...], ...]  # each set of arguments gets the same outcome
    refused: str | None


def _each(option: str, *values: str) -> tuple[tuple[str, ...], ...]:
    return tuple((option, value) for value in values)


OPTION_CASES = [
    OptionCase("workers-below-and-above", _each("--workers", "-1", "65"),
               "--workers: must be in 0..64:"),
    OptionCase("max-attempts-below-and-above", _each("--max-attempts", "0", "1001"),
               "--max-attempts: must be in 1..1000:"),
    OptionCase("concurrency-below-and-above", _each("--concurrency", "0", "10001"),
               "--concurrency: must be in 1..10000:"),
    OptionCase("concurrency-not-ascii", _each("--concurrency", "\uff13", "\u0663", "1_0"),
               "--concurrency: not an integer (ASCII digits)"),
    OptionCase("rps-below-and-above", _each("--rps", "0", "-1", "1e9"),
               "--rps: must be a number in 0.01..100000 POSTs per second:"),
    OptionCase("burst-below-and-above", _each("--rate-burst-seconds", "0", "-1", "4000"),
               "--rate-burst-seconds: must be a number above 0 and at most 3600 seconds:"),
    # Issue 29.9: any limit from 0.01 per minute admits requests (a bucket smaller than
    # one request admits one once it is full); below it, one range for both options.
    OptionCase("rpm-tpm-below-and-above",
               _each("--rpm", "-1", "1e13", "0.009", "1e-300") + _each("--tpm", "0", "1e-300"),
               "must be a number in 0.01..1e12 per minute:"),
    OptionCase("control-rpm", (("--rpm", "1"), ("--rpm", "0.01"), ("--tpm", "0.01"),
                               ("--rpm", "60", "--rate-burst-seconds", "1"),
                               ("--tpm", "100", "--rate-burst-seconds", "0.5"),
                               ("--rpm", "1", "--rate-burst-seconds", "3600"),
                               ("--rpm", "600", "--rate-burst-seconds", "0.5"),
                               ("--workers", "2", "--rpm", "1", "--tpm", "1000")), None),
    OptionCase("control-ranges", (("--workers", "64"), ("--max-attempts", "1000"),
                                  ("--concurrency", "10000"), ("--rps", "0.01")), None),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=[case.name for case in OPTION_CASES])
def test_numeric_options_state_their_one_real_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: OptionCase
) -> None:
    out = str(tmp_path / "out.jsonl")
    for args in case.args:
        if case.refused is None:
            # every check of the batch's options (nothing is opened or run)
            parsed = build_parser().parse_args(["batch", "jobs.jsonl", "--out", out, *args])
            assert _batch_config(parsed).jobs_path == "jobs.jsonl"
            continue
        assert main(["batch", str(tmp_path / "jobs.jsonl"), "--out", out, *args]) == 2, args
        assert case.refused in capsys.readouterr().err, args
        assert not (tmp_path / "out.jsonl.store").exists()  # refused before anything ran


def test_worker_concurrency_states_the_range_the_worker_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / "missing-store")
    assert main(["worker", "--store", store, "--concurrency", "20000"]) == 2
    assert "--concurrency: must be in 1..10000" in capsys.readouterr().err


def test_worker_rate_limits_take_the_batchs_ranges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29.6: ``recoverable worker --rpm/--tpm/--rate-burst-seconds`` (what
    ``batch --workers`` passes), checked as the batch's and given to its runtime."""
    store = str(tmp_path / "missing-store")
    for args in (("--rpm", "0.001"), ("--tpm", "1e13"), ("--rate-burst-seconds", "0")):
        assert main(["worker", "--store", store, *args]) == 2, args
        assert f"{args[0]}: must be a number" in capsys.readouterr().err, args
    assert not Path(store).exists()
    config = worker_config(build_parser().parse_args(
        ["worker", "--store", store, "--rpm", "1", "--tpm", "5000", "--rate-burst-seconds", "2"]))
    assert (config.requests_per_minute, config.tokens_per_minute,
            config.rate_burst_seconds) == (1.0, 5000.0, 2.0)
    config = worker_config(build_parser().parse_args(["worker", "--store", store]))
    assert (config.requests_per_minute, config.tokens_per_minute,
            config.rate_burst_seconds) == (None, None, DEFAULT_BURST_SECONDS)


# -- 8: damaged queue rows are corrupt_record (or skipped), never invalid_request -------------


def _enqueue(operation_id: str) -> Any:
    return lambda txn: txn.enqueue(operation_id)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [(b"\xff junk", "does not decode"),
     (encode_member(12345, resume=False), "serial 12345 names no order row")],
    ids=["membership-row-that-does-not-decode", "membership-row-with-a-flipped-serial"],
)
def test_a_damaged_queue_row_is_a_corrupt_record_naming_the_table_and_row(
    store_location: str, damage: bytes, problem: str
) -> None:
    with recoverable.RecoveryStore.open(store_location) as store:
        store.write_sync(_enqueue("op_a"))
        store.write_sync(lambda txn: txn.put_raw("queue", member_key("op_a"), damage))
        with pytest.raises(errors.CorruptRecord) as caught:
            store.write_sync(_enqueue("op_a"))  # submit again, a worker's suspension, ...
        assert caught.value.code == "corrupt_record"
        assert caught.value.operation_id == "op_a"
        assert f"queue table, row {member_key('op_a')!r}: " in str(caught.value)
        assert problem in str(caught.value)
        assert store.get_raw("queue", member_key("op_a")) == damage  # left as it is


def test_a_flipped_serial_never_takes_another_operation_out_of_the_queue(
    store_location: str,
) -> None:
    with recoverable.RecoveryStore.open(store_location) as store:
        store.write_sync(_enqueue("op_a"))
        store.write_sync(_enqueue("op_b"))
        # op_a's membership row now names op_b's serial (2)
        store.write_sync(lambda txn: txn.put_raw(
            "queue", member_key("op_a"), encode_member(2, resume=False)))
        store.write_sync(lambda txn: txn.dequeue("op_a"))
        assert [entry.operation_id for entry in store.queued()] == ["op_b"]


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [(order_key(99), b"a\0b", "malformed queue order row"),
     (order_key(98), b"\xff\xfe", "malformed queue order row"),
     (b"w" + b"own\xffer\0token", encode_worker(WorkerRow(
         account_id="a", source="api-key", endpoint_id="e", concurrency=1, started_at=0.0)),
      "malformed worker row")],
    ids=["order-row-naming-an-id-with-nul", "order-row-naming-bytes-not-utf8",
         "worker-row-with-a-key-not-ascii"],
)
def test_a_queue_row_no_operation_or_worker_could_have_is_skipped_and_named(
    store_location: str, key: bytes, value: bytes, named: str
) -> None:
    with recoverable.RecoveryStore.open(store_location) as store:
        store.write_sync(_enqueue("op_a"))

        def damage(txn: Any) -> None:
            txn.put_raw("queue", key, value)
            if key.startswith(b"s"):  # its membership row agrees: only the id is bad
                txn.put_raw("queue", b"o" + value, encode_member(
                    int.from_bytes(key[1:], "big"), resume=False))

        store.write_sync(damage)
        # What a worker reads: a bad row is never an operation id (an InvalidRequest
        # ended the worker) nor a worker to remove (a UnicodeEncodeError did).
        assert [entry.operation_id for entry in store.queued()] == ["op_a"]
        assert store.workers() == []
        assert any(named in problem for problem in store.check_integrity())


def test_a_jobs_text_in_the_batch_summary_and_messages_is_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model name is the job's own text: the summary's cost row quotes it, and a job's
    message may quote it; neither reaches the terminal raw."""
    hostile = "gpt-\x1b[2J\u202etest"
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(0, model=hostile)])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out.jsonl")]) == 0
    captured = capsys.readouterr()
    assert "\x1b[2J" not in captured.out + captured.err
    assert "\u202e" not in captured.out + captured.err
    assert "gpt-\\x1b[2J\\u202etest" in captured.out  # "no price for ..." in the summary
