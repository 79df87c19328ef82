"""Plant the bugs a student would make in week 3, one at a time, and check each costs most of a day's points.

    pdm run python -m maint.mutations                    # the honest solution, then every mutation
    pdm run python -m maint.mutations --list             # the mutations, by name
    pdm run python -m maint.mutations eos-leaks-blocks   # some of them (the honest run comes first still)
    pdm run python -m maint.mutations --day 5            # the ones that must hurt day 3.5, graded on it alone

A submission shaped like the skeleton is written to a temporary directory: the skeleton's files, with
every week-3 module replaced by the reference's (the week-3 days written, honestly). It must score
full marks on every week-3 day. Then each mutation, a small textual patch of that submission's code
(the bug a student writes), is graded by the grader itself (`scripts/grade.py --src`, the course's
isolated pytest runner, its time limits included) on the days it must hurt, and must lose more than
half of each one's points. The table printed names, per mutation and day, the points lost and the
tests that failed.

A patch whose text is no longer in the reference is reported as stale (exit 1): rewrite it against
the new code. Takes a few minutes (every mutation is a grading run); not part of CI.
Exit status: 0 when every mutation is caught, 1 when one is not (or is stale), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from course.course_map import DAYS, find_day

REPO_ROOT = Path(__file__).resolve().parent.parent
SKELETON = REPO_ROOT / "src" / "tiny_llm"
REFERENCE = REPO_ROOT / "src_ref" / "tiny_llm_ref"
WEEK = 3


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, as a student would describe what they wrote
    days: tuple[int, ...]  # the week-3 days it must cost most of the points of
    patches: tuple[tuple[str, str, str], ...]  # (module, text in the reference, replacement)


MUTATIONS = [
    Mutation("eos-leaks-blocks", "blocks not freed when a sequence ends by EOS", (1,), (
        ("scheduler", '            self.finish(seq, "stop")\n', "            self.running.remove(seq)\n"),)),
    Mutation("preempt-drops-output", "preemption drops the tokens generated so far", (2,), (
        ("scheduler", "        seq.num_computed_tokens = 0\n        seq.status = SequenceStatus.WAITING\n",
         "        seq.num_computed_tokens = 0\n        seq.output_token_ids.clear()\n"
         "        seq.status = SequenceStatus.WAITING\n"),)),
    Mutation("admit-without-free-blocks", "a waiting sequence admitted without checking free blocks", (1,), (
        ("scheduler", "        length = min(length, room)\n", ""),)),
    Mutation("prefills-before-decodes", "prefills planned before decodes (room kept for the decodes)", (1,), (
        ("scheduler", "        self.schedule_decodes(plan)\n        self.schedule_prefills(plan, budget - len(plan.decodes))\n",
         "        self.schedule_prefills(plan, budget - num_decoding)\n        self.schedule_decodes(plan)\n"),)),
    Mutation("oldest-preempted", "the oldest running sequence preempted instead of the newest", (1,), (
        ("scheduler", "                victim = self.running[-1]\n", "                victim = self.running[0]\n"),)),
    # Since the engine refactor the next three sit in provided code (engine.run, Scheduler.admit and
    # update_from_output's hook): a student no longer writes them, but the tests must still catch them.
    Mutation("failed-step-leaks", "a failed model call does not release the step's sequences", (1,), (
        ("engine", "        try:\n            tokens = self.runner.run(plan)\n        except BaseException:\n"
                   "            self.release_all()  # a failed step must not leak the blocks of the sequences it held\n"
                   "            raise\n",
         "        tokens = self.runner.run(plan)\n"),)),
    Mutation("no-observe-step", "the engine never feeds observe_step to the budget policy", (1,), (
        ("engine", "        self.scheduler.token_budget.observe_step(plan.num_tokens, len(plan.decodes), self.clock() - start)\n",
         ""),)),
    Mutation("prefix-hooks-never-called", "the prefix-cache hooks never called at admission and after a step", (3,), (
        ("scheduler", "        cached = self.block_manager.reuse_cached_prefix(seq)\n", "        cached = 0\n"),
        ("scheduler", "        self.block_manager.record_lookup(seq, cached)\n", ""),
        ("scheduler", "            self.block_manager.cache_computed_blocks(seq)  # day 3.3: its new full blocks become shareable\n",
         ""),)),
    Mutation("seed-alone", "a seeded sequence re-seeded with its seed alone every step", (1,), (
        ("model_runner", "                mx.random.seed(params.seed + len(seq.output_token_ids))\n",
         "                mx.random.seed(params.seed)\n"),)),
    Mutation("budget-ignores-decodes", "the prefill budget not reduced by the planned decodes", (1,), (
        ("scheduler", "        self.schedule_prefills(plan, budget - len(plan.decodes))\n",
         "        self.schedule_prefills(plan, budget)\n"),)),
    Mutation("hit-never-recorded", "a prefix-cache hit never recorded", (3,), (
        ("prefix_cache", "        self.hit_tokens += cached_tokens\n", ""),)),
    Mutation("shared-block-freed", "a block freed while another sequence shares it", (3,), (
        ("prefix_cache", "            if self.ref_counts[block] > 0:\n                continue\n", ""),)),
    Mutation("priority-ignored-on-preemption", "priorities ignored on preemption: any running sequence is a victim",
             (4,), (
        ("scheduler", "        while self.running and self.order.outranks(seq, self.running[-1]) and not self.can_admit(seq):\n",
         "        while self.running and not self.can_admit(seq):\n"),)),
    Mutation("priority-never-preempts", "a more urgent request never takes slots or blocks from a less urgent one",
             (4,), (
        ("scheduler", "        while self.running and self.order.outranks(seq, self.running[-1]) and not self.can_admit(seq):\n"
                      "            self.preempt(self.running[-1], plan)\n", ""),)),
    # Day 3.5: the server. The first and last live in provided code (the handler's token loop).
    Mutation("finish-reason-always-stop", "every finished request reported with finish reason 'stop'", (5,), (
        ("server", '                    generation.finish_reason = "length" if output.finish_reason == "length" else "stop"\n',
         '                    generation.finish_reason = "stop"\n'),)),
    Mutation("stop-string-kept", "the text is cut after the stop string instead of before it", (5,), (
        ("server", "        return min(found), True\n", "        return len(text), True\n"),)),
    Mutation("detokenizer-repeats", "the detokenizer's offsets never move: each piece repeats the text so far", (5,), (
        ("server", "        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)\n", ""),)),
    Mutation("output-sent-twice", "the engine thread sends each step output twice", (5,), (
        ("server", "                self.send(handle, output)\n",
         "                self.send(handle, output)\n                self.send(handle, output)\n"),)),
    Mutation("abort-forgets-only", "an abort forgets the handle but never calls engine.abort (blocks kept)", (5,), (
        ("server", '            elif command == "abort" and self.handles.pop(argument, None) is not None:\n'
                   "                self.engine.abort(argument)\n",
         '            elif command == "abort":\n                self.handles.pop(argument, None)\n'),)),
    Mutation("disconnect-not-aborted", "a client that leaves is not aborted: its request runs to max_tokens", (5,), (
        ("server", "            if not engine_done or text.stopped:\n", "            if text.stopped:\n"),)),
]


def week_days() -> list[int]:
    return [d.day for d in DAYS if d.week == WEEK]


def week_modules() -> set[str]:
    return {module for d in DAYS if d.week == WEEK for module in d.modules}


def honest_submission(dest: Path) -> None:
    """The skeleton's files, with every week-3 module the reference's: week 3 written, weeks 1-2 not."""
    dest.mkdir(parents=True)
    for path in SKELETON.glob("*.py"):
        shutil.copyfile(path, dest / path.name)
    for module in week_modules():
        shutil.copyfile(REFERENCE / f"{module}.py", dest / f"{module}.py")


def plant(dest: Path, mutation: Mutation) -> list[str]:
    """Apply the mutation's patches to the submission in `dest`; the patches whose text is missing (stale)."""
    stale = []
    for module, old, new in mutation.patches:
        path = dest / f"{module}.py"
        text = path.read_text()
        if text.count(old) != 1:
            stale.append(f"{module}.py: {old.strip().splitlines()[0]!r} found {text.count(old)} times, not once")
            continue
        path.write_text(text.replace(old, new))
    return stale


def grade(submission: Path, days: list[int], work: Path, attempts: int = 2,
          day_budget: float | None = None) -> dict[int, dict] | str:
    """Grade `days` of week 3 with the grader: day -> {"lost", "max", "failed": [(test, points lost)]}.

    A grading run that fails on the grader's side (exit 2: on a busy machine, a test process that does
    not start in time) is tried again once; if it fails again, the grader's last lines (a str).
    """
    report = work / "results.json"
    command = [sys.executable, "-m", "scripts.grade", "--src", str(submission), "--week", str(WEEK),
               "--day", *map(str, days), "--json", str(report)]
    if day_budget is not None:
        command += ["--day-budget", str(day_budget)]
    for _ in range(attempts):
        report.unlink(missing_ok=True)
        finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
        if finished.returncode == 0 and report.exists():
            break
    else:
        lines = (finished.stdout + finished.stderr).strip().splitlines()
        return f"the grader failed (status {finished.returncode}): " + " | ".join(lines[-6:])
    results = {day: {"lost": 0.0, "max": float(sum(find_day(WEEK, day).points.values())), "failed": []} for day in days}
    for test in json.loads(report.read_text())["tests"]:
        day = int(test["tags"][1].split(".")[1])
        if test["score"] < test["max_score"]:
            lost = test["max_score"] - test["score"]
            results[day]["lost"] += lost
            results[day]["failed"].append((test["name"].split(": ", 1)[1], lost))
    return results


def describe_failures(failed: list[tuple[str, float]]) -> str:
    """The failed tests, grouped by function: 'test_x (3 cases, 12.5 points), test_y (60 points)'."""
    by_function: dict[str, list[float]] = {}
    for name, lost in failed:
        by_function.setdefault(name.split("[")[0], []).append(lost)
    parts = []
    for function, losses in by_function.items():
        cases = f"{len(losses)} cases, " if len(losses) > 1 else ""
        parts.append(f"{function} ({cases}{sum(losses):g} points)")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run python -m maint.mutations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="only these mutations (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--day-budget", type=float, default=None, metavar="SECONDS",
                        help="each day's time budget, passed to the grader (default: the grader's, from the recorded "
                             "honest times); for a busy machine or a day whose tests changed since they were recorded")
    parser.add_argument("--day", type=int, action="append", choices=week_days(), metavar="D",
                        help=f"only the mutations that must hurt day {WEEK}.D, and the honest run of those days "
                             "(repeatable; default: every day)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for mutation in MUTATIONS:
            print(f"{mutation.name:32} day(s) {', '.join(f'{WEEK}.{d}' for d in mutation.days)}: {mutation.what}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        build_parser().error(f"unknown mutation(s): {', '.join(sorted(unknown))} (see --list)")
    chosen = [m for m in MUTATIONS if (not args.names or m.name in args.names)
              and (not args.day or set(m.days) & set(args.day))]
    problems = 0
    with tempfile.TemporaryDirectory(prefix="tiny-llm-mutations-") as tmp:
        honest = Path(tmp) / "honest"
        honest_submission(honest)
        baseline = grade(honest, args.day or week_days(), Path(tmp), day_budget=args.day_budget)
        if isinstance(baseline, str):
            print(f"FAIL honest week-3 solution: {baseline}")
            return 1
        for day, result in baseline.items():
            ok = result["lost"] == 0
            problems += not ok
            print(f"{'ok  ' if ok else 'FAIL'} honest week-3 solution, day {WEEK}.{day}: "
                  f"{result['max'] - result['lost']:g}/{result['max']:g}"
                  + ("" if ok else f"; failed: {describe_failures(result['failed'])}"), flush=True)
        for mutation in chosen:
            submission = Path(tmp) / mutation.name
            shutil.copytree(honest, submission)
            stale = plant(submission, mutation)
            if stale:
                problems += 1
                print(f"STALE {mutation.name}: " + "; ".join(stale), flush=True)
                continue
            results = grade(submission, [d for d in mutation.days if not args.day or d in args.day], Path(tmp),
                            day_budget=args.day_budget)
            if isinstance(results, str):
                problems += 1
                print(f"ERROR {mutation.name}: {results}", flush=True)
                continue
            for day, result in results.items():
                caught = result["lost"] > result["max"] / 2
                problems += not caught
                print(f"{'ok  ' if caught else 'MISS'} {mutation.name} ({mutation.what}), day {WEEK}.{day}: "
                      f"lost {result['lost']:g} of {result['max']:g}; failed: "
                      f"{describe_failures(result['failed']) or 'nothing'}", flush=True)
    print(f"mutations: {'every one caught' if not problems else f'{problems} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
