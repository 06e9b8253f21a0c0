"""Dashboard scale: ``recoverable dashboard`` over a store of 100,000 operations.

Run:  python bench/dashboard_scale.py [--records 100000] [--samples 20]
                                      [--out bench/results/dashboard_scale.md] [--quick]

The store is filled as ``bench/store_scale.py`` fills it (70% prepared, 20% in a saved
cooldown, 10% completed, ~1 KiB frozen body each). Then:

- in this process, ``build_summary(store)`` (the one read of the whole store the dashboard
  makes when the store changed, in a worker thread) is timed;
- the dashboard runs as its own process (``python -m recoverable dashboard``), and its
  pages are timed over real HTTP on 127.0.0.1 (httpx, one keep-alive connection): the
  first request (it waits for the first summary), the operation list's first page, a
  page deep in the list (its cursor taken after ~99% of the rows), a walk over every page
  (200 rows each), filtered list pages (the console's filters: a new filter each time,
  and the same one again), a bulk preview over the filter ``state=completed`` (10,000
  operations at 100,000: each read fresh and checked by the per-operation rules), the
  overview, one operation's page, ``/api/summary``; and the dashboard process's resident
  memory. The targets: a filtered list page under 100 ms (p50), a bulk preview of 10,000
  operations under 1 s.

``--quick``: 2,000 records, 5 samples (a few seconds); no results file unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import store_scale

import recoverable
from recoverable.dashboard.data import build_summary

GiB = 2**30


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def rss_mib(pid: int) -> tuple[float, float]:
    """(private memory, mapped store pages) of a process in MiB: ``RssAnon`` and
    ``RssFile`` (the LMDB file's pages it read: page cache, shared and reclaimable)."""
    found = {"RssAnon:": float("nan"), "RssFile:": float("nan")}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            name, *rest = line.split()
            if name in found:
                found[name] = int(rest[0]) / 1024.0
    return found["RssAnon:"], found["RssFile:"]


def timed(fn: Callable[[], Any], samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def preview(client: httpx.Client, base: str, spec: str) -> None:
    """A bulk preview over a filter (nothing is done): the list's CSRF token, then the
    preview's POST; checks that it lists the whole selection."""
    page = client.get("/operations").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf is not None
    answer = client.post("/bulk/preview", headers={"origin": base}, data={
        "csrf": csrf.group(1), "action": "acknowledge", "target": "filter", "filter": spec})
    assert answer.status_code == 200, answer.text[:300]
    assert 'id="bulk-count">' in answer.text


def measure_http(
    path: str, ids: list[str], samples: int
) -> tuple[list[list[str]], tuple[float, float]]:
    rows: list[list[str]] = []

    def row(what: str, values: list[float], note: str = "") -> None:
        rows.append([what, str(len(values)), fmt_ms(_common.percentile(values, 50)),
                     fmt_ms(_common.percentile(values, 99)), fmt_ms(max(values)), note])

    proc = subprocess.Popen(
        [sys.executable, "-m", "recoverable", "dashboard", "--store", path,
         "--account", store_scale.ACCOUNT.account_id],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_common.child_env(),
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    base = info["url"].split("/?token=")[0]
    rng = random.Random(11)
    try:
        with httpx.Client(base_url=base, timeout=120, follow_redirects=False) as client:
            assert client.get(info["url"]).status_code == 303

            def get(url: str, **params: Any) -> httpx.Response:
                response = client.get(url, params=params)
                assert response.status_code == 200, (url, response.status_code)
                return response

            row("first request (waits for the first summary)",
                timed(lambda: get("/api/summary"), 1))
            total = get("/api/summary").json()["total"]
            row("GET /api/operations first page (50)",
                timed(lambda: get("/api/operations"), samples))
            row("GET /operations first page (HTML, 50)",
                timed(lambda: get("/operations"), samples))
            # Walk every page, 200 rows each, keeping a cursor deep in the list.
            walk: list[float] = []
            cursor: str | None = None
            seen = 0
            deep: str | None = None
            while True:
                t0 = time.perf_counter()
                page = get("/api/operations", limit=200,
                           **({"cursor": cursor} if cursor else {})).json()
                walk.append(time.perf_counter() - t0)
                seen += len(page["operations"])
                cursor = page["next_cursor"]
                if cursor is not None:
                    deep = cursor  # the last one: the list's final 200 rows follow it
                if cursor is None:
                    break
            assert seen == total, (seen, total)
            row("walk: every page of /api/operations (200)", walk,
                f"{len(walk)} pages, {seen} rows")
            assert deep is not None
            row("GET /operations deepest page (HTML, 50)",
                timed(lambda: get("/operations", cursor=deep), samples))
            row("GET /operations?state=prepared first page",
                timed(lambda: get("/operations", state="prepared"), samples))
            # The console's filters: a new filter each sample (no selection cached), then
            # the same one again (its selection is kept for its next pages).
            prefixes = iter(range(10, 10 + samples))
            row("filtered list page, a new filter each time",
                timed(lambda: get("/operations", state="prepared", model="gpt-scale",
                                  q=f"job-{next(prefixes)}", sort="updated"), samples),
                "state+model+q prefix, sort=updated")
            since = "1970-01-02T00:00Z"
            row("filtered list page, the same filter again",
                timed(lambda: get("/operations", availability="waiting", since=since),
                      samples), "availability+since")
            row("filtered list page (API), a new filter each time",
                timed(lambda: get("/api/operations", kind="disconnected",
                                  code="ws_close_1006", q=f"op_{rng.randrange(16):x}"),
                      samples), "kind+code+q prefix")
            completed = get("/api/operations", state="completed", limit=1).json()["matching"]
            row(f"bulk preview of {completed} operations (POST /bulk/preview)",
                timed(lambda: preview(client, base, "state=completed"), max(3, samples // 4)),
                "acknowledge every completed one: each read fresh, rules applied")
            row("GET / (overview)", timed(lambda: get("/"), samples))
            row("GET /operations/{id} (random)",
                timed(lambda: get(f"/operations/{rng.choice(ids)}"), samples))
            row("GET /api/summary", timed(lambda: get("/api/summary"), samples))
        memory = rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=None, help="100000; quick 2000")
    parser.add_argument("--samples", type=int, default=None, help="20; quick 5")
    parser.add_argument("--out", default=None,
                        help="results file (default bench/results/dashboard_scale.md; "
                             "quick: none)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 2000 records, 5 samples, no file")
    args = parser.parse_args()
    quick = args.quick
    records = args.records if args.records is not None else (2000 if quick else 100_000)
    samples = args.samples if args.samples is not None else (5 if quick else 20)
    if args.out is None and not quick:
        args.out = str(Path(__file__).resolve().parent / "results" / "dashboard_scale.md")
    base = tempfile.mkdtemp(prefix="dashboard-scale-")
    path = os.path.join(base, "store")
    try:
        store = recoverable.RecoveryStore.open(path, max_bytes=8 * GiB)
        try:
            t0 = time.perf_counter()
            ids = store_scale.build(store, records, 100)
            fill = time.perf_counter() - t0
            summaries = timed(lambda: build_summary(store), 3)
        finally:
            store.close()
        rows, memory = measure_http(path, ids, samples)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows.insert(0, ["build_summary(store) (in this process)", str(len(summaries)),
                    fmt_ms(_common.percentile(summaries, 50)),
                    fmt_ms(_common.percentile(summaries, 99)), fmt_ms(max(summaries)),
                    "the dashboard's one read of the store, in a thread"])
    headers = ["what", "samples", "p50 ms", "p99 ms", "max ms", "note"]
    title = (f"{records} operations (filled in {fill:.1f} s); dashboard process memory: "
             f"{memory[0]:.0f} MiB private (RssAnon), {memory[1]:.0f} MiB of mapped store "
             "pages (RssFile: page cache)")
    print(title)
    print(_common.table(headers, rows))
    if args.out is None:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = ["# Dashboard scale (bench/dashboard_scale.py)", "",
          f"Command: `python bench/dashboard_scale.py {' '.join(sys.argv[1:])}`".strip(),
          "", title + f"; {os.cpu_count()} CPUs (shared with other work), page cache warm.",
          "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(cell) + " |" for cell in rows]
    out.write_text("\n".join(md) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
