"""Soak under fire: 2,000 jobs at concurrency 200, the host SIGKILLed 50 times.

Run:  python bench/soak.py [--jobs 2000] [--concurrency 200] [--kills 50] [--seed 1]
                           [--faults SPEC] [--max-attempts 8] [--dir DIR] [--quick]

The fixture provider runs in its own process with random faults; the host
(``tests/crash/soak_driver.py``) runs every job's host loop (prepare, persist
handle, send_recovering, commit keyed by (job, revision), acknowledge) and is
killed at random moments, restarted, and finally left to finish. Prints the
totals (kills, jobs, committed, failed, duplicates, losses, POSTs) and every
invariant violation; exits 1 if there is any.

``--quick``: 10 jobs at concurrency 10, 1 kill (a few seconds; the same checks).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.crash.soak_driver import DEFAULT_FAULTS, run_soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="2000; quick 10")
    parser.add_argument("--concurrency", type=int, default=None, help="200; quick 10")
    parser.add_argument("--kills", type=int, default=None, help="50; quick 1")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", default=DEFAULT_FAULTS + ",schema_violation=0.002")
    parser.add_argument("--max-attempts", type=int, default=8)
    parser.add_argument("--idle-timeout", type=float, default=None, help="3 s; quick 1 s")
    parser.add_argument("--dir", help="work directory (kept); default: a temporary one")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 10 jobs, concurrency 10, 1 kill")
    args = parser.parse_args()
    quick = args.quick
    jobs = args.jobs if args.jobs is not None else (10 if quick else 2000)
    concurrency = args.concurrency if args.concurrency is not None else (10 if quick else 200)
    kills = args.kills if args.kills is not None else (1 if quick else 50)
    idle_timeout = args.idle_timeout if args.idle_timeout is not None else (1.0 if quick else 3.0)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run_soak(
            workdir, jobs=jobs, concurrency=concurrency, kills=kills,
            max_attempts=args.max_attempts, faults=args.faults, seed=args.seed,
            idle_timeout=idle_timeout, deadline=3600.0,
            log=lambda line: print(line, flush=True),
        )
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"kills={result.kills} jobs={result.jobs} committed={result.committed} "
        f"failed={result.failed} duplicates={result.duplicates} losses={result.lost} "
        f"POSTs={result.posts}"
    )
    print(f"host starts={result.host_starts} adopted orphans={result.adopted_orphans} "
          f"failure codes={result.failure_codes} seconds={result.seconds:.1f}")
    print(f"replies={dict(sorted(result.reply_kinds.items()))}")
    print(f"attempts of failed jobs={dict(sorted(result.failed_attempts.items()))}")
    for violation in result.violations:
        print("VIOLATION:", violation)
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
