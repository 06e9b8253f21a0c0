"""Issue 19.5 / 19.10: OpenAI Batch API files, Batch-style output, the errors file,
``--retry-failed`` and the progress line, through ``recoverable batch`` as a real process
(and the line parser in-process)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import recoverable
from recoverable.cli.jobs import (
    BATCH_REVISION_PREFIX,
    JobLineError,
    batch_revision,
    parse_job_line,
    read_jobs,
)
from recoverable.cli.progress import fit_width
from recoverable.cli.provider import FIXTURE_ACCOUNT
from recoverable.cli.result_log import ResultLog, ResultLogError

from .cli_helpers import SMALL_SCHEMA, assert_exactly_once, job_line, run_cli, write_jobs


def batch_line(i: int, **body_changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gpt-test",
        "instructions": "Label the text.",
        "input": f"text number {i}",
        "temperature": 0.2,
        "service_tier": "flex",
        "text": {"format": {"type": "json_schema", "name": "label", "schema": SMALL_SCHEMA,
                            "strict": True}},
    }
    body.update(body_changes)
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/responses", "body": body}


def _stat(stdout: str, name: str) -> str:
    for row in stdout.splitlines():
        if row.startswith(name + "  "):
            return row[len(name):].strip()
    raise AssertionError(f"no {name!r} row in:\n{stdout}")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _batch_ops(store_dir: Path) -> list[Any]:
    store = recoverable.RecoveryStore.open(str(store_dir))
    try:
        records, unreadable = store.inventory(account=FIXTURE_ACCOUNT, scope="batch")
        assert unreadable == []
        return list(records)
    finally:
        store.close()


# -- the line parser ---------------------------------------------------------------------------


def test_a_batch_api_line_becomes_a_job_whose_revision_follows_its_body() -> None:
    job = parse_job_line(json.dumps(batch_line(1)), 3)
    assert (job.id, job.lineno, job.source) == ("req-1", 3, "openai-batch")
    assert job.revision.startswith(BATCH_REVISION_PREFIX)
    assert job.response.name == "label" and job.response.schema == SMALL_SCHEMA
    assert job.request.temperature == 0.2 and job.request.service_tier == "flex"
    # Key order does not matter; any change of the body changes the revision.
    reordered = batch_line(1)
    reordered["body"] = dict(reversed(list(reordered["body"].items())))
    assert parse_job_line(json.dumps(reordered), 1).revision == job.revision
    changed = parse_job_line(json.dumps(batch_line(1, temperature=0.3)), 1)
    assert changed.revision != job.revision and changed.body_hash != job.body_hash
    assert job.revision == batch_revision(batch_line(1)["body"])
    # --revision gives every Batch line the same revision.
    assert parse_job_line(json.dumps(batch_line(1)), 1, revision="v2").revision == "v2"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"url": "/v1/chat/completions"}, "only /v1/responses"),
        ({"method": "GET"}, "only POST"),
        ({"body": {"model": "gpt-test", "input": "x"}}, "body.text.format is missing"),
        ({"body": {**batch_line(1)["body"], "text": {"format": {"type": "text"}}}},
         "body.text.format"),
        ({"body": {**batch_line(1)["body"], "text": {"format": {
            "type": "json_object", "name": "x", "schema": {}}}}}, "only json_schema"),
        ({"body": {**batch_line(1)["body"], "text": {"format": {
            "type": "json_schema", "name": "x", "schema": SMALL_SCHEMA, "strict": False}}}},
         "strict must be true"),
        ({"body": {**batch_line(1)["body"], "frequency_penalty": 1}}, "frequency_penalty"),
        ({"body": {**batch_line(1)["body"], "tools": [{"type": "web_search"}]}}, "tools"),
        ({"body": {k: v for k, v in batch_line(1)["body"].items() if k != "model"}}, "model"),
        ({"custom_id": ""}, "custom_id must be"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_bad_batch_api_lines_are_job_line_errors_naming_the_line(
    change: dict[str, Any], reason: str
) -> None:
    line = {**batch_line(1), **change}
    with pytest.raises(JobLineError) as caught:
        parse_job_line(json.dumps(line), 7)
    assert caught.value.lineno == 7 and reason in caught.value.reason, caught.value.reason


def test_a_file_may_not_mix_formats_and_a_custom_id_names_one_body(tmp_path: Path) -> None:
    path = write_jobs(tmp_path / "jobs.jsonl", [
        batch_line(1),
        job_line(2),  # the other format: refused, named by its line
        batch_line(1),  # the same request again: a duplicate, run once
        batch_line(1, input="other text"),  # the same custom_id with another body
        batch_line(3),
    ])
    jobs = read_jobs(str(path))
    assert jobs.format == "openai-batch"
    assert [j.id for j in jobs.jobs] == ["req-1", "req-3"]
    assert jobs.duplicates == [(3, 1)]
    bad = {b.lineno: b.reason for b in jobs.bad_lines}
    assert set(bad) == {2, 4}
    assert "may not mix" in bad[2] and "line 1" in bad[2]
    assert "custom_id 'req-1' is used by line 1" in bad[4]
    # With a fixed --revision, another body under it is the revision conflict.
    fixed = read_jobs(str(path), revision="v1")
    assert fixed.conflicts == [(4, 1)]


# -- the command line ----------------------------------------------------------------------------


def test_a_batch_api_file_runs_and_commits_each_job_once_in_batch_output_format(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "batch.jsonl", [batch_line(i) for i in range(5)])
    out = tmp_path / "out.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                   "--faults", "disconnect=0.3,seed=4", "--backoff", "0.01")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(out)
    assert sorted(x["custom_id"] for x in lines) == [f"req-{i}" for i in range(5)]
    for x in lines:
        op_id = x["recoverable"]["operation_id"]
        assert x["id"] == f"batch_req_{op_id}" and x["error"] is None
        assert x["response"]["status_code"] == 200
        assert x["response"]["request_id"].startswith(op_id + ".")
        body = x["response"]["body"]
        assert body["object"] == "response" and body["status"] == "completed"
        assert body["id"].startswith("resp_") and body["model"] == "gpt-test"
        value = json.loads(body["output_text"])
        assert value["label"] in ("a", "b") and 0 <= value["score"] <= 10
        assert body["output"][0]["content"][0]["text"] == body["output_text"]
        assert body["usage"]["total_tokens"] == (
            body["usage"]["input_tokens"] + body["usage"]["output_tokens"]
        )
    assert _batch_ops(Path(str(out) + ".store")) == []  # every job acknowledged

    # A rerun reads the Batch-style output back: nothing is sent or written again.
    before = out.read_bytes()
    again = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch")
    assert again.returncode == 0, again.stderr
    assert _stat(again.stdout, "committed (earlier runs)") == "5"
    assert _stat(again.stdout, "POSTs (attempts spent)") == "0"
    assert out.read_bytes() == before

    # The other output format on the same file is refused before anything runs.
    other = run_cli("batch", str(jobs), "--out", str(out))
    assert other.returncode == 2
    assert "--output-format openai-batch" in other.stderr and out.read_bytes() == before

    # An edited body is a new revision: that job runs again, the others stay committed.
    edited = write_jobs(tmp_path / "batch.jsonl",
                        [batch_line(0, input="new text")] + [batch_line(i) for i in range(1, 5)])
    third = run_cli("batch", str(edited), "--out", str(out), "--output-format", "openai-batch")
    assert third.returncode == 0, third.stderr
    assert _stat(third.stdout, "committed (this run)") == "1"
    keys = {(x["custom_id"], x["recoverable"]["revision"]) for x in _lines(out)}
    assert len(keys) == 6 and sum(1 for k in keys if k[0] == "req-0") == 2


def test_bad_and_mixed_lines_are_reported_with_line_numbers(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "batch.jsonl", [
        batch_line(1),
        {**batch_line(2), "url": "/v1/embeddings"},
        {**batch_line(3), "method": "PUT"},
        job_line(4),
        batch_line(5),
    ])
    out = tmp_path / "out.jsonl"
    errors_file = tmp_path / "errors.jsonl"
    proc = run_cli("batch", str(jobs), "--out", str(out), "--errors", str(errors_file))
    assert proc.returncode == 1
    assert f"{jobs}:2: skipped: url '/v1/embeddings'" in proc.stderr
    assert f"{jobs}:3: skipped: method 'PUT'" in proc.stderr
    assert f"{jobs}:4: skipped: a recoverable job line" in proc.stderr
    assert _stat(proc.stdout, "skipped lines") == "3"
    assert sorted(x["id"] for x in _lines(out)) == ["req-1", "req-5"]
    errs = _lines(errors_file)
    assert [(e["line"], e["code"], e["id"]) for e in errs] == [
        (2, "invalid_job_line", "req-2"), (3, "invalid_job_line", "req-3"),
        (4, "invalid_job_line", None),
    ]


def test_errors_file_has_one_line_per_failed_job_and_retry_failed_creates_successors_once(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "batch.jsonl", [batch_line(i) for i in range(3)])
    out = tmp_path / "out.jsonl"
    errors_file = tmp_path / "errors.jsonl"
    store = Path(str(out) + ".store")
    first = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                    "--errors", str(errors_file), "--faults", "schema_violation=1.0",
                    "--max-attempts", "1")
    assert first.returncode == 1
    assert _lines(out) == []
    errs = _lines(errors_file)
    assert sorted(e["custom_id"] for e in errs) == ["req-0", "req-1", "req-2"]
    sources = {op.job_id: op.operation_id for op in _batch_ops(store)}
    for e in errs:
        assert e["response"] is None and e["error"]["code"] == "provider_error"
        meta = e["recoverable"]
        assert meta["operation_id"] == sources[e["custom_id"]]
        assert e["id"] == f"batch_req_{meta['operation_id']}"
        assert meta["reason"] == "provider_error:invalid_output:schema_violation"
        assert "--retry-failed" in meta["hint"] and "recoverable retry" in meta["hint"]
    assert _stat(first.stdout, "error lines").startswith("3 ")

    # Without --retry-failed a rerun spends nothing and creates nothing (no budget reset).
    plain = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                    "--errors", str(errors_file))
    assert plain.returncode == 1 and _stat(plain.stdout, "POSTs (attempts spent)") == "0"
    assert len(_batch_ops(store)) == 3 and len(_lines(errors_file)) == 3

    # --retry-failed: one successor per failed job, run now; each job ends committed.
    retried = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                      "--errors", str(errors_file), "--retry-failed")
    assert retried.returncode == 0, retried.stderr
    assert "--retry-failed: 3 manual retries created" in retried.stderr
    assert _stat(retried.stdout, "manual retries created") == "3 (--retry-failed)"
    assert _stat(retried.stdout, "POSTs (attempts spent)") == "3"
    lines = _lines(out)
    assert_exactly_once(
        [{"id": x["custom_id"], "revision": x["recoverable"]["revision"]} for x in lines],
        {(f"req-{i}", batch_revision(batch_line(i)["body"])) for i in range(3)},
    )
    for x in lines:  # the successor committed, never the spent source
        assert x["recoverable"]["operation_id"] != sources[x["custom_id"]]
    assert _lines(errors_file) == []  # rewritten per run: nothing failed this time
    # The sources keep their spent budget; their successors are acknowledged.
    kept = {op.operation_id: op for op in _batch_ops(store)}
    assert set(kept) == set(sources.values())
    assert all(op.attempts_used == 1 and op.retry_reservation is not None
               and op.retry_reservation.created for op in kept.values())

    # A rerun with --retry-failed creates nothing new: every job is committed.
    rerun = run_cli("batch", str(jobs), "--out", str(out), "--output-format", "openai-batch",
                    "--retry-failed")
    assert rerun.returncode == 0, rerun.stderr
    assert "--retry-failed: 0 manual retries created" in rerun.stderr
    assert _stat(rerun.stdout, "POSTs (attempts spent)") == "0"
    assert len(_lines(out)) == 3


def test_retry_failed_is_idempotent_per_source_when_the_successor_fails_too(
    tmp_path: Path,
) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    out = tmp_path / "out.jsonl"
    store = Path(str(out) + ".store")
    args = ("batch", str(jobs), "--out", str(out), "--faults", "schema_violation=1.0",
            "--max-attempts", "1")
    assert run_cli(*args).returncode == 1
    second = run_cli(*args, "--retry-failed")
    assert second.returncode == 1 and "--retry-failed: 1 manual retry created" in second.stderr
    ops = _batch_ops(store)
    assert len(ops) == 2  # the source and its one successor
    # A plain rerun runs the (failed) successor again: nothing sent, nothing created.
    third = run_cli(*args)
    assert third.returncode == 1 and _stat(third.stdout, "POSTs (attempts spent)") == "0"
    assert len(_batch_ops(store)) == 2


def test_non_tty_progress_lines_carry_state_counts_tokens_and_cost(tmp_path: Path) -> None:
    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(4)])
    out = tmp_path / "out.jsonl"
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"gpt-test": {"input": 1.0, "cached_input": 0.5,
                                               "output": 4.0}}))
    proc = run_cli("batch", str(jobs), "--out", str(out), "--prices", str(prices))
    assert proc.returncode == 0, proc.stderr
    pattern = re.compile(
        r"^\[\s*\d+\.\ds\] done (\d+)/4  running (\d+)  waiting (\d+)  failed (\d+)  "
        r"unfinished (\d+)  attempts (\d+)  tokens (\d+) \(in (\d+), out (\d+)\)  "
        r"cost (\$\d+\.\d{4}|-)  \d+\.\d jobs/s  eta (\S+)$"
    )
    progress = [m for m in map(pattern.match, proc.stdout.splitlines()) if m]
    assert progress, proc.stdout
    last = progress[-1]
    assert last.group(1) == "4" and last.group(4) == "0" and last.group(5) == "0"
    total, given, made = (int(last.group(n)) for n in (7, 8, 9))
    assert total == given + made > 0
    assert _stat(proc.stdout, "tokens total") == str(total)
    assert last.group(10) != "-"  # every model has a price: the cost is shown
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout  # plain lines off a TTY


def test_a_garbled_first_line_does_not_decide_the_format(tmp_path: Path) -> None:
    path = write_jobs(tmp_path / "jobs.jsonl", ["{nope", batch_line(1), "[1]", batch_line(2)])
    jobs = read_jobs(str(path))
    assert jobs.format == "openai-batch" and [j.id for j in jobs.jobs] == ["req-1", "req-2"]
    bad = {b.lineno: b.reason for b in jobs.bad_lines}
    assert "not a JSON object" in bad[1] and "may not mix" not in bad[3]


def test_batch_output_log_reads_back_cuts_a_torn_tail_and_refuses_the_other_format(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.jsonl"
    whole = json.dumps({
        "id": "batch_req_op_1", "custom_id": "req-1",
        "recoverable": {"revision": "r", "operation_id": "op_1", "input_sha256": "ab"},
        "response": {"status_code": 200, "request_id": None, "body": {}}, "error": None,
    }, separators=(",", ":"))
    torn = whole.replace("req-1", "req-2").replace("op_1", "op_2")[:70]
    out.write_text(whole + "\n" + torn)
    log = ResultLog.open(str(out), "openai-batch")
    try:
        assert log.committed == {("req-1", "r"): "op_1"} and log.hashes == {("req-1", "r"): "ab"}
        assert log.truncated_bytes == len(torn)
    finally:
        log.close()
    assert out.read_text() == whole + "\n"
    with pytest.raises(ResultLogError, match="written with --output-format openai-batch"):
        ResultLog.open(str(out))


def test_usage_errors_of_the_new_options_exit_2_before_anything_runs(tmp_path: Path) -> None:
    own = write_jobs(tmp_path / "jobs.jsonl", [job_line(1)])
    out = tmp_path / "out.jsonl"
    revision = run_cli("batch", str(own), "--out", str(out), "--revision", "v1")
    assert revision.returncode == 2 and "--revision applies to OpenAI Batch API lines" in (
        revision.stderr)
    same = run_cli("batch", str(own), "--out", str(out), "--errors", str(out))
    assert same.returncode == 2 and "--errors" in same.stderr
    bad_format = run_cli("batch", str(own), "--out", str(out), "--output-format", "csv")
    assert bad_format.returncode == 2
    assert not out.exists() or out.read_text() == ""


def test_fit_width_keeps_the_live_line_on_one_row() -> None:
    text = "done 1/2  running 1  " * 10
    assert fit_width(text, None) == text and fit_width("short", 80) == "short"
    cut = fit_width(text, 60)
    assert len(cut) == 59 and cut.endswith("…")


def test_live_progress_on_a_terminal_never_wraps(tmp_path: Path) -> None:
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios

    from .cli_helpers import REPO, child_env, cli_command

    jobs = write_jobs(tmp_path / "jobs.jsonl", [job_line(i) for i in range(20)])
    out = tmp_path / "out.jsonl"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 70, 0, 0))
    proc = subprocess.Popen(
        cli_command("batch", str(jobs), "--out", str(out), "--rps", "40"),
        stdout=slave, stderr=subprocess.PIPE, cwd=REPO, env=child_env(),
    )
    os.close(slave)
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        data += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    text = data.decode("utf-8", "replace")
    redraws = [part for part in text.replace("\r\n", "\n").split("\r") if "done " in part]
    assert redraws, text
    for part in redraws:
        line = part.replace("\x1b[K", "").split("\n")[0]
        assert len(line) <= 69, line
