"""Run the same workload through the student's code and the reference, and show where they part.

    pdm run compare --week 1 --day 5                 # the week-1 model: logits and greedy text
    pdm run compare --week 2 --day 7                 # batch_generate with chunked prefill
    pdm run compare --week 2 --day 1 --max-tokens 32 --model Qwen/Qwen2-0.5B-Instruct-MLX

The student side is what the tests grade for that day (tests/harness.py): the student's files for
the day's modules, the reference for everything else. For each prompt it prints the largest logit
difference on the prompt's forward pass, the first generated token where the two differ with both
continuations from there, and the time ratio student / reference. Days without a model-level run
(attention, RoPE, metrics, ...) say so and give the test command instead.

Exit status: 0 when the student's run matches the reference; 1 when it differs or raises; 2 on bad
arguments.
"""

import argparse
import os
import re
import sys
import time
import traceback

from course.course_map import Day, find_day

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a cache that never misses.",
    "Explain chunked prefill in one sentence.",
]
WORKLOADS = ("model", "kv-cache", "batch", "chunked-prefill")  # the values of Day.compare, besides ""
LOGIT_TOLERANCE = 1e-3  # float32 on the CPU: a correct implementation differs by ~1e-5
CONTEXT_TOKENS = 4  # shared tokens shown before the first difference


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--week", type=int, required=True)
    parser.add_argument("--day", type=int, required=True)
    parser.add_argument("--model", default="embedded", help="embedded (default), bench-0.5b, a path or HF id")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three built-in ones")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens to generate per prompt (default 24)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="random seed, set before each run")
    parser.add_argument("--repeat", type=int, default=2, help="time each run this many times, keep the fastest")
    parser.add_argument("--batch-size", type=int, default=2, help="decode slots for batch days (default 2)")
    parser.add_argument("--prefill-step", type=int, default=None,
                        help="prefill chunk for batch days (default: whole prompts; 8 on the chunked-prefill day)")
    return parser


class StudentFailed(Exception):
    """The student's code raised: `message` says what, and where to read about it."""


def explain_failure(error: BaseException, day: Day) -> str:
    chapter = f"book/src/{day.chapter}"
    test = f"pdm run test --week {day.week} --day {day.day}"
    if isinstance(error, NotImplementedError):
        # The skeleton's message names the day and chapter of the missing piece, which can be an
        # earlier day's part of a module this day shares (batch.py: days 2.6 and 2.7).
        named = re.search(r"Week (\d+) Day (\d+) Task \d+ \((book/src/[^)\s]+)\)", str(error))
        if named and (int(named.group(1)), int(named.group(2))) != (day.week, day.day):
            week, number, other = int(named.group(1)), int(named.group(2)), named.group(3)
            return (f"not implemented yet: {error}\n  That piece is week {week} day {number}'s: read {other} and run "
                    f"`pdm run test --week {week} --day {number}`; this day's chapter is {chapter}.")
        return f"not implemented yet: {error}\n  Read {chapter}, then run `{test}`."
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/src/tiny_llm/" in f.filename]
    where = f" at {frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}: {error}{where}\n  See {chapter} and run `{test}`."


def student(day: Day, what, *args, **kwargs):
    try:
        return what(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any error in the student's code is reported, not raised
        raise StudentFailed(explain_failure(error, day)) from error


class RecordingSampler:
    """Wraps a sampler and remembers the token ids it returns, so greedy runs can be compared token by token."""

    def __init__(self, sampler):
        self.sampler, self.tokens = sampler, []

    def __call__(self, logprobs):
        token = self.sampler(logprobs)
        self.tokens.append(int(token.reshape(-1)[0].item()))
        return token


# ---------------------------------------------------------------- the workloads

def forward(kind: str, model, ids):
    if kind == "model":
        return model(ids)
    return model(ids, 0, model.make_cache())


def build_model(kind: str, package, mlx_model):
    if kind == "model":
        return package.qwen2_week1.Qwen2ModelWeek1(mlx_model)
    return package.qwen2_week2.Qwen2ModelWeek2(mlx_model)


def generate_each(kind, package, model, tokenizer, prompts, args):
    """Single-request runs: per prompt, (token ids, text, seconds)."""
    import mlx.core as mx

    generate = package.generate.simple_generate if kind == "model" else package.generate.simple_generate_with_kv_cache
    runs = []
    for prompt in prompts:
        seconds = []
        for _ in range(max(1, args.repeat)):  # the fastest of a few runs: less noise from a busy machine
            mx.random.seed(args.seed)
            sampler = RecordingSampler(package.sampler.make_sampler(args.temp, args.top_p, args.top_k))
            started = time.perf_counter()
            text = generate(model, tokenizer, prompt, sampler=sampler, max_tokens=args.max_tokens)
            seconds.append(time.perf_counter() - started)
        seconds = min(seconds)
        tokens = [t for t in sampler.tokens if t not in tokenizer.eos_token_ids]
        if not sampler.tokens and text:
            tokens = tokenizer.encode(text, add_special_tokens=False)  # the sampler was not used
        runs.append((tokens, text, seconds))
    return runs


def generate_batch(kind, package, model, tokenizer, prompts, args):
    """One batch_generate call for all prompts; token ids re-encoded from each text."""
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    step = args.prefill_step or (8 if kind == "chunked-prefill" else max(lengths))
    times = []
    for _ in range(max(1, args.repeat)):
        started = time.perf_counter()
        results = package.batch.batch_generate(model, tokenizer, prompts, max_seq_len=max(lengths) + args.max_tokens,
                                               batch_size=args.batch_size, prefill_step=step)
        times.append(time.perf_counter() - started)
    seconds = min(times)
    texts = dict(results)
    return [(tokenizer.encode(texts.get(i, ""), add_special_tokens=False), texts.get(i, ""), seconds / len(prompts))
            for i in range(len(prompts))], seconds


# ---------------------------------------------------------------- report

def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def show(text: str, limit: int = 100) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def compare(args) -> int:
    day = find_day(args.week, args.day)
    if not day.compare:
        print(f"week {day.week} day {day.day} ({day.title}: {', '.join(day.modules)}) builds pieces below the "
              f"model, so there is no model-level run to compare.\nIts tests check those pieces one by one "
              f"against independent oracles:\n    pdm run test --week {day.week} --day {day.day}")
        return 0

    if day.compare not in WORKLOADS:
        raise SystemExit(f"course/course_map.py: week {day.week} day {day.day} has compare={day.compare!r}; "
                         f"known workloads: {', '.join(WORKLOADS)}")
    from course import fast_mlx

    fast_mlx.setup()
    import mlx.core as mx

    from course.models import MEANINGLESS_NOTE, is_embedded, load_model, resolve_model

    os.environ["TINY_LLM_SOLUTION"] = "student"
    from tests.harness import reference, solution

    mine, ref = solution(day.week, day.day), reference()
    if is_embedded(resolve_model(args.model)):
        print(MEANINGLESS_NOTE)
    mlx_model, tokenizer = load_model(args.model)
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.prompt is None and getattr(tokenizer, "chat_template", None):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    kind = day.compare
    print(f"week {day.week} day {day.day}: {day.title}. Student: your {', '.join(day.modules)}; reference: the rest.")
    print(f"workload: {kind}, {len(prompts)} prompts, {args.max_tokens} tokens each, model {args.model}\n")

    problems = 0
    try:
        ref_model = build_model(kind, ref, mlx_model)
        my_model = student(day, build_model, kind, mine, mlx_model)
        model_is_theirs = bool({"qwen2_week1", "embedding"} & set(day.modules)) if kind == "model" else \
            bool({"qwen2_week2", "kv_cache"} & set(day.modules))

        logit_gaps = []
        for prompt in prompts:
            ids = mx.array([tokenizer.encode(prompt, add_special_tokens=False)])
            expected = forward(kind, ref_model, ids)
            got = student(day, forward, kind, my_model, ids)
            if got.shape != expected.shape:
                raise StudentFailed(f"your model's logits have shape {tuple(got.shape)}, the reference's "
                                    f"{tuple(expected.shape)}")
            gap = mx.max(mx.abs(got.astype(mx.float32) - expected.astype(mx.float32))).item()
            agree = mx.sum(mx.argmax(got, axis=-1) == mx.argmax(expected, axis=-1)).item()
            logit_gaps.append((gap, agree, ids.shape[1]))

        if kind in ("model", "kv-cache"):
            ref_runs = generate_each(kind, ref, ref_model, tokenizer, prompts, args)
            my_runs = student(day, generate_each, kind, mine, my_model, tokenizer, prompts, args)
            totals = None
        else:
            ref_runs, ref_total = generate_batch(kind, ref, ref_model, tokenizer, prompts, args)
            my_runs, my_total = student(day, generate_batch, kind, mine, my_model, tokenizer, prompts, args)
            totals = (my_total, ref_total)
    except StudentFailed as failed:
        print(f"your code raised: {failed}")
        return 1

    for index, (prompt, (gap, agree, length), ref_run, my_run) in enumerate(
            zip(prompts, logit_gaps, ref_runs, my_runs), start=1):
        (ref_tokens, ref_text, ref_s), (my_tokens, my_text, my_s) = ref_run, my_run
        print(f"prompt {index} ({length} tokens): {show(args.prompt[index - 1] if args.prompt else DEFAULT_PROMPTS[index - 1])}")
        note = "" if model_is_theirs else "  (the model is the reference's on this day)"
        print(f"  largest logit difference on the prompt: {gap:.2e}; next-token choice agrees at "
              f"{agree}/{length} positions{note}")
        problems += gap > LOGIT_TOLERANCE
        diverge = first_difference(my_tokens, ref_tokens)
        if diverge is None:
            print(f"  generated tokens: identical ({len(ref_tokens)} tokens)")
        else:
            problems += 1
            shared = tokenizer.decode(ref_tokens[max(0, diverge - CONTEXT_TOKENS):diverge])
            print(f"  generated tokens: first difference at token {diverge} of {len(ref_tokens)}"
                  f"{' (token ids re-encoded from the text)' if kind not in ('model', 'kv-cache') else ''}"
                  f"{f', after {show(shared)}' if shared else ''}")
            print(f"    reference continues: {show(tokenizer.decode(ref_tokens[diverge:]))}")
            print(f"    yours continues:     {show(tokenizer.decode(my_tokens[diverge:]))}")
        if totals is None:
            print(f"  time: yours {my_s:.3f} s, reference {ref_s:.3f} s, ratio {my_s / max(ref_s, 1e-9):.2f}")
    if totals is not None:
        print(f"\nbatch time (all prompts together): yours {totals[0]:.3f} s, reference {totals[1]:.3f} s, "
              f"ratio {totals[0] / max(totals[1], 1e-9):.2f}")
    if args.temp > 0:
        print("\n(sampling with temperature draws random numbers: equal results need the same draws in the same order)")
    print(f"\n{'your run matches the reference' if not problems else 'your run differs from the reference'}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
