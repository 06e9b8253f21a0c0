"""Job lines and the batch's commit log, in-process (real files, real fsync and flock)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from recoverable.cli.jobs import MAX_LINE_BYTES, JobLineError, parse_job_line, read_jobs
from recoverable.cli.result_log import ResultLog, ResultLogError

from .cli_helpers import SMALL_SCHEMA, job_line


def _line(**changes: Any) -> str:
    data = job_line(1)
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not _DROP})


_DROP: Any = object()


def test_a_valid_line_becomes_a_job_with_a_stable_body_hash() -> None:
    job = parse_job_line(_line(max_attempts=7), 4)
    assert (job.id, job.revision, job.lineno, job.max_attempts) == ("gen-0001", "r1", 4, 7)
    assert job.response.name == "label" and job.response.schema == SMALL_SCHEMA
    assert job.request.model == "gpt-test" and job.request.instructions == "Label the text."
    assert parse_job_line(_line(), 9).body_hash == job.body_hash
    assert parse_job_line(_line(input="other text"), 4).body_hash != job.body_hash
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert parse_job_line(_line(input=items, schema_name=_DROP), 1).response.name == "result"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{nope", "not a JSON object"),
        ("[1, 2]", "invalid job"),
        (_line(id=_DROP), "`id`"),
        (_line(tools=[{"type": "function"}]), "unknown field"),
        (_line(id=5), "Expected `str`"),
        (_line(id=""), "id must be"),
        (_line(revision="r\n1"), "revision must be"),
        (_line(id="x" * 257), "id must be"),
        (_line(max_attempts=0), "max_attempts"),
        (_line(max_attempts=1001), "max_attempts"),
        (_line(model=""), "model"),
        (_line(schema={"type": "object", "properties": {"a": {"type": "string"}}}),
         "additionalProperties"),
        (_line(schema={"type": "array"}), "object"),
        (_line(schema_name="has spaces"), "name"),
        (_line(input=[1]), "Expected `object`"),
    ],
)
def test_bad_lines_raise_a_typed_error_with_the_line_number(line: str, reason: str) -> None:
    with pytest.raises(JobLineError) as caught:
        parse_job_line(line, 12)
    assert caught.value.lineno == 12
    assert reason in caught.value.reason
    assert str(caught.value).startswith("line 12: ")


def test_oversized_line_is_refused_without_decoding() -> None:
    with pytest.raises(JobLineError, match="longer than"):
        parse_job_line(_line(input="x" * MAX_LINE_BYTES), 1)


def test_read_jobs_skips_blank_bad_oversized_and_duplicate_lines(tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    with path.open("wb") as fh:
        fh.write(_line().encode() + b"\n")
        fh.write(b"\n   \n")  # blank lines 2 and 3 are ignored
        fh.write(b'{"id": "\xff"}\n')  # 4: not UTF-8
        fh.write(b"y" * (3 * MAX_LINE_BYTES) + b"\n")  # 5: oversized, skipped in bounded reads
        fh.write(_line().encode() + b"\r\n")  # 6: duplicate of 1 (CRLF tolerated)
        fh.write(json.dumps(job_line(2)).encode())  # 7: last line without a newline
    jobs = read_jobs(str(path))
    assert [(j.id, j.lineno) for j in jobs.jobs] == [("gen-0001", 1), ("gen-0002", 7)]
    assert [(e.lineno, e.reason) for e in jobs.bad_lines] == [
        (4, "the line is not valid UTF-8"),
        (5, f"the line is longer than {MAX_LINE_BYTES} bytes"),
    ]
    assert jobs.duplicates == [(6, 1)]


async def test_result_log_group_commits_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    log = ResultLog.open(str(path))
    assert path.exists() and log.committed == {}

    async def append(i: int) -> None:
        line = {"id": f"j{i}", "revision": "r1", "operation_id": f"op_{i}", "result": {"i": i}}
        await log.append(json.dumps(line, separators=(",", ":")).encode())

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(append, i)
    assert 1 <= log.syncs < 40  # concurrent appends share fsyncs
    with pytest.raises(ValueError):
        await log.append(b'{"a":1}\n{"b":2}')
    log.close()
    reopened = ResultLog.open(str(path))
    try:
        assert reopened.committed == {(f"j{i}", "r1"): f"op_{i}" for i in range(40)}
        assert reopened.truncated_bytes == 0
    finally:
        reopened.close()


def test_result_log_cuts_a_torn_tail_and_refuses_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    good = b'{"id":"a","revision":"1","operation_id":"op_a","result":{"x":1}}\n'
    path.write_bytes(good + b'{"id":"b","revision":"1","operation_id":"op_')
    log = ResultLog.open(str(path))
    try:
        assert log.committed == {("a", "1"): "op_a"}
        assert log.truncated_bytes > 0
        assert path.read_bytes() == good
        # Only one writer per output file.
        with pytest.raises(ResultLogError, match="locked"):
            ResultLog.open(str(path))
    finally:
        log.close()
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_bytes(good + b'{"id": 1}\n')
    with pytest.raises(ResultLogError, match=r"foreign\.jsonl:2"):
        ResultLog.open(str(foreign))
    with pytest.raises(ResultLogError, match="cannot open"):
        ResultLog.open(str(tmp_path / "no-such-dir" / "out.jsonl"))
