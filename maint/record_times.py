"""Record each day's honest grading time, of which the grader's day caps are made (course/grading_times.json).

    pdm run python -m maint.record_times                     # every day, three rounds
    pdm run python -m maint.record_times --week 2 --day 6 7  # some days of a week
    pdm run python -m maint.record_times --rounds 5

Run it on a quiet machine after adding or changing a day's tests. It grades the reference submitted as a student's
work (`pdm run grade --src src_ref/tiny_llm_ref`, sandboxed) ROUNDS times and saves each day's slowest round, only
for a day that passed every test in every round: a run cut short is no honest run, and would shrink the next caps.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from course.course_map import find_day
from course.user_errors import OneLineParser
from scripts import grade


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m maint.record_times", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="only this week")
    parser.add_argument("--day", type=int, nargs="+", help="only these days of --week")
    parser.add_argument("--rounds", type=int, default=3, help="grade the selection this many times (default 3)")
    return parser


def grade_arguments(args: argparse.Namespace, report: Path) -> list[str]:
    """The grader's arguments for one round."""
    selection = ["--week", str(args.week)] if args.week is not None else []
    if args.day:
        selection += ["--day", *map(str, args.day)]
    return ["--src", str(grade.REPO_ROOT / grade.REFERENCE_DIR), "--json", str(report), *selection,
            "--day-budget", f"{grade.DEFAULT_DAY_CAP:g}"]  # the old times' caps must never cut a recording short


def record(rounds: list[dict], times_file: Path) -> None:
    """Save each day's slowest time of `rounds` (one results.json each) for the days that passed every test in all."""
    slowest, failed = {}, set()
    for results in rounds:
        for name, seconds in results["extra_data"]["seconds"].items():
            slowest[name] = max(slowest.get(name, 0.0), seconds)
        failed |= {tag.removeprefix("day ") for test in results["tests"] if test["status"] != "passed"
                   for tag in test["tags"] if tag.startswith("day ")}
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    for name in sorted(failed):
        print(f"[record_times] day {name}: not every test passed in every round; time not recorded")
    recorded = {}
    for name, seconds in slowest.items():
        if name not in failed:
            recorded[find_day(*map(int, name.split("."))).key] = round(seconds, 2)
    times_file.write_text(json.dumps(dict(sorted({**times, **recorded}.items())), indent=1) + "\n")
    print(f"[record_times] {times_file}: {', '.join(f'{key} {s:g} s' for key, s in recorded.items()) or 'nothing new'}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tiny-llm-record-times-") as tmp:
        for number in range(args.rounds):
            report = Path(tmp) / f"round-{number}.json"
            status = grade.main(grade_arguments(args, report))
            if status not in (0, grade.GRADER_FAILED) or not report.exists():  # interrupted, or refused to grade
                raise SystemExit(f"record_times: the grader stopped (exit status {status}); nothing recorded")
            rounds.append(json.loads(report.read_text()))
    record(rounds, grade.TIMES_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
