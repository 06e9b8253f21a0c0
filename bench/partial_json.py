"""Partial-JSON reading of a streamed structured answer: jiter (now) against the former
hand-written reader, in the same run.

    python bench/partial_json.py [--answers 20] [--items 30] [--repeats 3] [--quick]

The workload is what a live operation's consumer does (``docs/live.md``): an answer of
a realistic structured shape (a title, a summary paragraph, a list of items with names,
scores, booleans, tags and notes; about 4-5 KB of pretty JSON at the default 30 items)
arrives in deltas of 2-12 characters, and every prefix is read with ``parse_partial``,
the worst case (a consumer taking every view). Both readers read the same prefixes;
the time is the best of ``--repeats`` runs. The script also counts the prefixes where
the two readings differ (expected: 0 on this workload, which has no lone surrogates and
no nesting past the bound) and prints the ratio hand-written / jiter.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _partial_handwritten import parse_partial as handwritten

from recoverable.partial import parse_partial as with_jiter

WORDS = ("delta stream partial answer durable record attempt token budget price model "
         "schema label score value review summary note item reason evidence").split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def answer(rng: random.Random, items: int) -> str:
    """One structured answer as a model would stream it (pretty, non-ASCII kept)."""
    value = {
        "title": _sentence(rng, 6),
        "summary": " ".join(_sentence(rng, 14) for _ in range(4)) + " Café ✓",
        "items": [
            {
                "name": _sentence(rng, 3),
                "score": rng.randint(0, 100),
                "confidence": round(rng.random(), 3),
                "accepted": rng.random() < 0.5,
                "tags": [rng.choice(WORDS) for _ in range(rng.randint(1, 4))],
                "note": None if rng.random() < 0.3 else _sentence(rng, 8),
            }
            for _ in range(items)
        ],
        "total": items,
    }
    return json.dumps(value, indent=2, ensure_ascii=False)


def prefixes(rng: random.Random, text: str) -> list[str]:
    """The texts a consumer sees: the answer cut after each delta of 2-12 characters."""
    cuts: list[str] = []
    end = 0
    while end < len(text):
        end = min(len(text), end + rng.randint(2, 12))
        cuts.append(text[:end])
    return cuts


def best_time(reader: Callable[[str], Any], views: list[list[str]], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for answer_views in views:
            for text in answer_views:
                reader(text)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=20)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="4 answers of 5 items, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.answers, args.items, args.repeats = 4, 5, 1
    rng = random.Random(args.seed)
    texts = [answer(rng, args.items) for _ in range(args.answers)]
    views = [prefixes(rng, text) for text in texts]
    count = sum(len(answer_views) for answer_views in views)
    differ = sum(
        handwritten(text) != with_jiter(text) for answer_views in views for text in answer_views
    )
    old = best_time(handwritten, views, args.repeats)
    new = best_time(with_jiter, views, args.repeats)
    mean_chars = sum(len(text) for text in texts) / len(texts)
    print(f"answers {args.answers}, {mean_chars:.0f} chars each on average, "
          f"{count} views read, best of {args.repeats}")
    print(f"{'reader':<12} {'total s':>9} {'us/view':>9}")
    print(f"{'handwritten':<12} {old:>9.4f} {old / count * 1e6:>9.1f}")
    print(f"{'jiter':<12} {new:>9.4f} {new / count * 1e6:>9.1f}")
    print(f"views read differently: {differ}")
    print(f"handwritten / jiter = {old / new:.2f}")
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
