"""What the grader's sandbox and time budgets cost, per day, side by side in one run.

    pdm run bench-grading                        # every day
    pdm run bench-grading --week 1               # one week
    pdm run bench-grading --week 2 --day 6 7     # some days of a week
    pdm run bench-grading --no-sleeper           # only the honest grade against the unsandboxed tests
    pdm run bench-grading --week 3 --solution student   # your src/tiny_llm instead of the reference

For each day, three commands, one after the other:

- unsandboxed: `pdm run test --week W --day D --ref`, the day's tests in one pytest process with the
  reference imported into it (what grading cost before the sandbox);
- graded: `pdm run grade --src src_ref/tiny_llm_ref --week W --day D`, the reference submitted as a
  student's work: every test through the sandbox, within the day's time budget;
- sleeper: `pdm run grade --src <the skeleton, every task sleeping 59 s before it raises>`, the
  submission the time budgets are there for.

With `--solution student` the first two run your `src/tiny_llm` (`pdm run test --week W --day D` and
`pdm run grade --week W --day D`): what grading your work costs, and where it is slow.

The first two alternate their order from one day to the next, so a burst of load on a shared machine
falls on either. It prints each command's wall time, the ratios (graded / unsandboxed: the sandbox's
cost; sleeper / graded: the budgets' bound, at most 1.5 intended) per day, per week and overall, with the
load average before each day, and saves them to benches/results/grading_cost.json (--out). Where a cgroup can be
made (Linux as root), each command's CPU seconds too, with everything it started (the sandboxed workers
included): on a busy machine the wall times move with the load, the CPU times far less.
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course import cgroup
from course.course_map import DAYS
from course.user_errors import OneLineParser

REPO_ROOT = Path(__file__).resolve().parent.parent
SUBMISSIONS = {"ref": REPO_ROOT / "src_ref" / "tiny_llm_ref", "student": REPO_ROOT / "src" / "tiny_llm"}
SLEEP_SECONDS = 59  # just under the default per-test limit of 60 s
TASK_RAISE = re.compile(r'^(\s*)(raise NotImplementedError\("Week \d+ Day \d+ Task)', re.MULTILINE)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="pdm run bench-grading", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, help="only this week")
    parser.add_argument("--day", type=int, nargs="+", help="only these days of --week")
    parser.add_argument("--no-sleeper", action="store_true", help="leave out the sleeping submission")
    parser.add_argument("--solution", choices=["ref", "student"], default="ref",
                        help="whose code the honest grade and the unsandboxed tests run: ref, src_ref/tiny_llm_ref; "
                             "student, your src/tiny_llm (default ref)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benches" / "results" / "grading_cost.json"),
                        help="where to save the figures (default benches/results/grading_cost.json)")
    return parser


def sleeper_submission(dest: Path) -> Path:
    """The untouched skeleton with every task sleeping just under the per-test limit before it raises."""
    package = dest / "tiny_llm"
    shutil.copytree(REPO_ROOT / "src" / "tiny_llm", package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in package.glob("*.py"):
        path.write_text(TASK_RAISE.sub(rf'\1__import__("time").sleep({SLEEP_SECONDS})\n\1\2', path.read_text()))
    return package


def cpu_group() -> tuple[Path, str] | None:
    """A new cgroup that counts CPU time (v1 cpuacct, or v2's cpu.stat), and the file to read; None where this user
    cannot make one. Accounting only: the scheduling of what runs in it does not change."""
    name = f"tiny-llm-bench-{os.getpid()}-{time.monotonic_ns()}"
    v2 = cgroup._v2_root()
    for base, counter in ((cgroup.MOUNTS / "cpuacct", "cpuacct.usage"), (v2, "cpu.stat")):
        if base is not None and (base / counter).exists():
            try:
                (base / name).mkdir()
                return base / name, counter
            except OSError:
                continue
    return None


def cpu_seconds(group: tuple[Path, str]) -> float | None:
    directory, counter = group
    try:
        text = (directory / counter).read_text()
    except OSError:
        return None
    try:
        directory.rmdir()
    except OSError:
        pass  # a process outlived the command: the group stays, empty once it ends
    if counter == "cpu.stat":  # "usage_usec N" (v2)
        return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6
    return int(text) / 1e9  # nanoseconds (v1)


def timed(command: list[str], report: Path | None = None) -> dict:
    """Wall seconds of one command, its CPU seconds with everything it started, and the score it reported (graded
    commands). The CPU time counts the sandboxed workers too (bubblewrap does not pass their use on to its parent's
    rusage): a cgroup's count, where one can be made; on a busy machine it moves far less than the wall time."""
    group = cpu_group()
    join = (lambda: (group[0] / "cgroup.procs").write_text(str(os.getpid()))) if group else None
    began = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, preexec_fn=join,
                          env={**os.environ, "PDM_CHECK_UPDATE": "false", "PYTHONPATH": "src:src_ref:."})
    seconds = time.monotonic() - began
    result = {"seconds": round(seconds, 2), "status": done.returncode}
    cpu = cpu_seconds(group) if group else None
    if cpu is not None:
        result["cpu"] = round(cpu, 2)
    if report is not None and report.exists():
        results = json.loads(report.read_text())
        result["score"], result["max_score"] = results["score"], results["extra_data"]["max_score"]
        report.unlink()
    elif done.returncode != 0:
        result["tail"] = (done.stdout + done.stderr)[-500:]
    return result


def grade_command(src: Path, week: int, day: int, report: Path) -> list[str]:
    return [sys.executable, "-m", "scripts.grade", "--src", str(src), "--week", str(week), "--day", str(day),
            "--json", str(report)]


def ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}" if b else "    -"


def table(rows: list[dict], sleeper: bool) -> str:
    cpu = all("cpu" in r["unsandboxed"] and "cpu" in r["graded"] for r in rows)
    lines = [f"{'day':>5} {'load':>5} {'unsandboxed':>11} {'graded':>8} {'ratio':>6}"
             + (f" {'cpu: unsandboxed':>16} {'graded':>7} {'ratio':>6}" if cpu else "")
             + (f" {'sleeper':>8} {'ratio':>6}" if sleeper else "") + "  graded score"]
    groups = [(f"{r['week']}.{r['day']}", [r]) for r in rows]
    weeks = sorted({r["week"] for r in rows})
    groups += [(f"wk {w}", [r for r in rows if r["week"] == w]) for w in weeks] + [("all", rows)]
    for name, group in groups:
        plain = sum(r["unsandboxed"]["seconds"] for r in group)
        graded = sum(r["graded"]["seconds"] for r in group)
        load = sum(r["load"] for r in group) / len(group)
        line = f"{name:>5} {load:5.1f} {plain:10.1f}s {graded:7.1f}s {ratio(graded, plain)}"
        if cpu:
            plain_cpu, graded_cpu = (sum(r[k]["cpu"] for r in group) for k in ("unsandboxed", "graded"))
            line += f" {plain_cpu:15.1f}s {graded_cpu:6.1f}s {ratio(graded_cpu, plain_cpu)}"
        if sleeper:
            slept = sum(r["sleeper"]["seconds"] for r in group)
            line += f" {slept:7.1f}s {ratio(slept, graded)}"
        scores = [r["graded"] for r in group]
        line += f"  {sum(s.get('score', 0) for s in scores):g} / {sum(s.get('max_score', 0) for s in scores):g}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.day and args.week is None:
        parser.error("--day needs --week")
    days = [d for d in DAYS if (args.week is None or d.week == args.week) and (not args.day or d.day in args.day)
            and (REPO_ROOT / d.test_file).exists()]
    if not days:
        raise SystemExit("bench-grading: no day with tests in that selection")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tiny-llm-bench-grading-") as tmp:
        report = Path(tmp) / "results.json"
        sleeper = sleeper_submission(Path(tmp) / "sleeper")
        for index, day in enumerate(days):
            row = {"week": day.week, "day": day.day, "load": os.getloadavg()[0]}
            plain = [sys.executable, "-m", "scripts.run_tests", "--week", str(day.week), "--day", str(day.day),
                     "--solution", args.solution, "--", "-q"]
            graded = grade_command(SUBMISSIONS[args.solution], day.week, day.day, report)
            order = ["unsandboxed", "graded"] if index % 2 == 0 else ["graded", "unsandboxed"]
            for name in order:
                row[name] = timed(plain) if name == "unsandboxed" else timed(graded, report)
            if not args.no_sleeper:
                row["sleeper"] = timed(grade_command(sleeper, day.week, day.day, report), report)
            rows.append(row)
            print(table([row], not args.no_sleeper).splitlines()[1], flush=True)
    print()
    print(table(rows, not args.no_sleeper))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
                               "solution": args.solution,
                               "commands": {"unsandboxed": f"pdm run test --week W --day D --solution {args.solution}",
                                            "graded": f"pdm run grade --src {SUBMISSIONS[args.solution].relative_to(REPO_ROOT)} "
                                                      "--week W --day D",
                                            "sleeper": "pdm run grade --src <skeleton, every task sleeping 59 s>"},
                               "days": rows}, indent=1) + "\n")
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
