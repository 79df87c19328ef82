"""Check that `pdm run compare --week W --day D` tells an honest engine from a broken one (weeks 3 and 4).

    pdm run python -m maint.check_compare              # every week-3 day honest, every mutation on its days
    pdm run python -m maint.check_compare --day 1      # day 3.1 only
    pdm run python -m maint.check_compare --week 4     # days 4.1 (speculative decoding), 4.2 (quantized pool), 4.5
    pdm run python -m maint.check_compare --week 4 --day 5   # day 4.5 (structured outputs) only

In a temporary copy of the repository whose `src/tiny_llm` holds the reference's code (a finished,
honest solution), `compare` must report no difference on any day of the week. Then each mutation below
(a bug a student would plant) is applied to that copy alone, and `compare` must report a
difference (exit status 1) on each of its days (the preemption bugs on day 3.1 too: day 3.1's
engine runs the student's day-3.2 scheduler code as well). Exits 1 naming every case that went the wrong way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from course.scratch import copy_repository

REPO = Path(__file__).resolve().parent.parent
COPIED = ("src", "src_ref", "course", "scripts")
DAYS = {3: (1, 2, 3, 4), 4: (1, 2, 5)}


@dataclass(frozen=True)
class Mutation:
    name: str
    days: tuple[int, ...]  # the days of `week` whose compare must catch it
    module: str  # file of src/tiny_llm
    old: str  # text that occurs exactly once in the reference's module
    new: str
    week: int = 3


MUTATIONS = [
    Mutation("the oldest running sequence preempted instead of the newest", (1, 2), "scheduler",
             "                victim = self.running[-1]\n", "                victim = self.running[0]\n"),
    Mutation("preemption keeps num_computed_tokens", (1, 2), "scheduler",
             "        self.block_manager.free(seq)\n        seq.num_computed_tokens = 0\n        seq.status = SequenceStatus.WAITING\n",
             "        self.block_manager.free(seq)\n        seq.status = SequenceStatus.WAITING\n"),
    Mutation("the prefill budget not reduced by the planned decodes", (1,), "scheduler",
             "        self.schedule_prefills(plan, budget - len(plan.decodes))\n",
             "        self.schedule_prefills(plan, budget)\n"),
    Mutation("a prefix-cache hit never recorded", (3,), "prefix_cache",
             "        self.hit_tokens += cached_tokens\n", ""),
    Mutation("priorities ignored in the ranking", (4,), "order_policy",
             "        return (-self.effective_priority(seq), self.arrival_step[seq])\n",
             "        return (0, self.arrival_step[seq])\n"),
    Mutation("no token of the target's own when every guess is accepted", (1,), "speculative",
             "    accepted.append(target_tokens[len(accepted)])\n    return accepted\n",
             "    if len(accepted) < len(draft):\n        accepted.append(target_tokens[len(accepted)])\n"
             "    return accepted\n", week=4),
    Mutation("rolled back to the end of the verify chunk: rejected positions kept", (1,), "speculative",
             "        self.scheduler.roll_back(seq, chunk.start + len(accepted))\n",
             "        self.scheduler.roll_back(seq, chunk.start + chunk.length)\n", week=4),
    Mutation("dequantize given the biases as scales and the scales as biases", (2,), "quantized_kv",
             "    return dequantize(packed, scales.astype(dtype), biases.astype(dtype), group_size, bits)\n",
             "    return dequantize(packed, biases.astype(dtype), scales.astype(dtype), group_size, bits)\n", week=4),
    Mutation("bytes per token count the keys and forget the values", (2,), "quantized_kv",
             "    return 2 * num_layers * num_kv_heads * per_head\n",
             "    return num_layers * num_kv_heads * per_head\n", week=4),
    Mutation("the mask of the state before the newest token", (5,), "structured",
             "    for token in seq.output_token_ids[consumed:]:\n        state = constraint.next_state(state, token)\n"
             "    seq.constraint_progress = (len(seq.output_token_ids), state)\n",
             "    for token in seq.output_token_ids[consumed:-1]:\n        state = constraint.next_state(state, token)\n"
             "    seq.constraint_progress = (max(len(seq.output_token_ids) - 1, 0), state)\n", week=4),
    Mutation("EOS allowed in every state", (5,), "structured",
             "        if automaton.accepts(state):\n            allowed[vocab.eos_token_ids] = True\n",
             "        allowed[vocab.eos_token_ids] = True\n", week=4),
    Mutation("tokens that split a UTF-8 character never allowed", (5,), "structured",
             "        allowed[vocab.ids] = states != DEAD\n",
             "        whole = [vocab.token_bytes[i].decode('utf-8', 'replace').encode() == vocab.token_bytes[i] "
             "for i in vocab.ids]\n        allowed[vocab.ids] = (states != DEAD) & np.array(whole)\n", week=4),
    Mutation("a string's maxLength off by one", (5,), "structured",
             "            return string(self.nfa, src, *bounds(schema, \"minLength\", \"maxLength\"))\n",
             "            low, high = bounds(schema, \"minLength\", \"maxLength\")\n"
             "            return string(self.nfa, src, low, None if high is None else high + 1)\n", week=4),
]


def honest_copy(into: Path) -> None:
    """The repository's code under `into`, with the reference's modules as the student's solution."""
    copy_repository(into, COPIED)
    for module in (REPO / "src_ref" / "tiny_llm_ref").glob("*.py"):
        shutil.copy(module, into / "src" / "tiny_llm" / module.name)


def apply(root: Path, mutation: Mutation) -> str:
    """Plant `mutation` in the copy; return the module's text before, to put it back."""
    path = root / "src" / "tiny_llm" / f"{mutation.module}.py"
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(f"maint/check_compare.py: mutation {mutation.name!r}: its text is not found exactly once "
                         f"in src_ref/tiny_llm_ref/{mutation.module}.py; update it")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def compare(root: Path, day: int, week: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": "src:src_ref:."}
    return subprocess.run([sys.executable, "-m", "scripts.compare", "--week", str(week), "--day", str(day)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)


def check(days=DAYS[3], mutations=None, week: int = 3) -> list[str]:
    """Run every case on `days` of `week` (default: that week's mutations); return the ones that went the wrong way
    (empty: all good)."""
    mutations = [m for m in MUTATIONS if m.week == week] if mutations is None else mutations
    failures = []
    with tempfile.TemporaryDirectory(prefix="tiny-llm-compare-") as tmp:
        root = Path(tmp)
        honest_copy(root)
        for day in days:
            result = compare(root, day, week)
            verdict = "no difference" if result.returncode == 0 else f"exit {result.returncode}"
            print(f"honest solution, day {week}.{day}: {verdict}", flush=True)
            if result.returncode != 0:
                failures.append(f"honest solution, day {week}.{day}: {result.stdout[-2000:]}{result.stderr[-2000:]}")
        for mutation in mutations:
            before = apply(root, mutation)
            try:
                for day in (d for d in mutation.days if d in days):
                    result = compare(root, day, week)
                    caught = result.returncode == 1 and "differs from the reference" in result.stdout
                    print(f"{mutation.name}, day {week}.{day}: {'reported' if caught else 'NOT reported'}", flush=True)
                    if not caught:
                        failures.append(f"{mutation.name}, day {week}.{day}: exit {result.returncode}\n"
                                        f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
            finally:
                (root / "src" / "tiny_llm" / f"{mutation.module}.py").write_text(before)
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maint.check_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, choices=sorted(DAYS), default=3, help="the week (default 3)")
    parser.add_argument("--day", type=int, choices=(1, 2, 3, 4, 5), action="append",
                        help="day(s) of the week to check (default all)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    failures = check(tuple(args.day or DAYS[args.week]), week=args.week)
    for failure in failures:
        print(f"\nWRONG: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
