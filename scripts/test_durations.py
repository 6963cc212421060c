"""Where the last test run's time went: seconds per file and per test, with the machine that ran it.

    make test-durations                                   # the last `make test` or `make test-all`
    .venv/bin/python scripts/test_durations.py --xml .edgeflow/test-results/junit.xml --tests 40

`make test` and `make test-all` write pytest's JUnit XML (every test's setup + call + teardown seconds, so a module
fixture's start is counted in its file's first test and its stop in the last) and, beside it, machine.json (CPU
model, ISA flags, cores; written by tests/conftest.py when the run starts). This prints:
- the run: when, how many passed/failed/skipped, its wall time, the machine;
- each file's seconds (with `--dist loadfile` a file runs whole on one pytest worker, so its sum is that worker's
  time on it), largest first, with its share of all test seconds;
- the slowest tests.
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_XML = REPO / ".edgeflow" / "test-results" / "junit.xml"


def read_cases(xml: Path) -> tuple[dict, list[dict]]:
    """(the run's summary, one dict per test case: file, name, seconds, outcome) from a JUnit XML file."""
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise SystemExit(f"{xml}: no <testsuite> element; is it pytest's --junitxml output?")
    cases = []
    for case in suite.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        classname = case.get("classname", "")
        # pytest writes the module as a dotted classname (tests.pipeline.test_multihost[.Class])
        parts = classname.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        file = "/".join(parts) + ".py" if parts else classname
        cases.append({"file": file, "name": case.get("name", ""), "seconds": float(case.get("time") or 0.0),
                      "outcome": outcome})
    summary = {"timestamp": suite.get("timestamp", "?"), "wall_s": float(suite.get("time") or 0.0),
               "hostname": suite.get("hostname", "?")}
    return summary, cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--xml", type=Path, default=DEFAULT_XML, help=f"JUnit XML of the run (default {DEFAULT_XML})")
    ap.add_argument("--tests", type=int, default=30, help="how many of the slowest tests to list (default 30)")
    ap.add_argument("--markdown", action="store_true", help="tables in Markdown, for BENCHMARKS.md")
    args = ap.parse_args(argv)
    if not args.xml.exists():
        print(f"{args.xml} does not exist: run `make test` (or `make test-all`) first; it writes it", file=sys.stderr)
        return 2
    summary, cases = read_cases(args.xml)
    machine_file = args.xml.with_name("machine.json")
    machine = json.loads(machine_file.read_text()) if machine_file.exists() else {}
    counts = defaultdict(int)
    for c in cases:
        counts[c["outcome"]] += 1
    total = sum(c["seconds"] for c in cases) or 1.0
    print(f"run of {summary['timestamp']} on {summary['hostname']}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
          + f"; {summary['wall_s']:.0f} s wall, {total:.0f} s of test time")
    if machine:
        print(f"machine: {machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores, ISA {' '.join(machine.get('isa', []))}"
              + (f"; pytest workers: {machine['workers']}" if "workers" in machine else ""))

    per_file: dict[str, list[float]] = defaultdict(list)
    for c in cases:
        per_file[c["file"]].append(c["seconds"])
    rows = sorted(per_file.items(), key=lambda kv: -sum(kv[1]))
    bar = "|" if args.markdown else ""
    print()
    print(f"{bar} file {bar} tests {bar} s {bar} share {bar}" if args.markdown else f"{'file':<52} {'tests':>5} {'s':>8} {'share':>6}")
    if args.markdown:
        print("|---|---|---|---|")
    for file, secs in rows:
        if args.markdown:
            print(f"| {file} | {len(secs)} | {sum(secs):.0f} | {100 * sum(secs) / total:.1f} % |")
        else:
            print(f"{file:<52} {len(secs):>5} {sum(secs):>8.1f} {100 * sum(secs) / total:>5.1f}%")

    print()
    slow = sorted(cases, key=lambda c: -c["seconds"])[: args.tests]
    if args.markdown:
        print("| test | s | outcome |\n|---|---|---|")
    for c in slow:
        if args.markdown:
            print(f"| {c['file']}::{c['name']} | {c['seconds']:.0f} | {c['outcome']} |")
        else:
            print(f"{c['seconds']:>8.1f}  {c['outcome']:<7} {c['file']}::{c['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
