"""Run the same workload through the student's code and the reference, and show where they part.

    pdm run compare --week 1 --day 5                 # the week-1 model: logits and greedy text
    pdm run compare --week 2 --day 7                 # batch_generate with chunked prefill
    pdm run compare --week 2 --day 1 --max-tokens 32 --model Qwen/Qwen2-0.5B-Instruct-MLX
    pdm run compare --week 2 --day 1 --loop plain    # day 2.1's plain loop (Task 3) instead of the pipelined one (Task 4)
    pdm run compare --week 3 --day 2                 # your engine, step by step, on a small KV pool
    pdm run compare --week 4 --day 1                 # your speculative engine: guesses accepted, rolled back, blocks
    pdm run compare --week 4 --day 2                 # your 8-bit and 4-bit pools: blocks, bytes, every step and token
    pdm run compare --week 4 --day 5                 # constrained requests among free ones: every step, token and mask

The student side is your src/tiny_llm as the selector (course/selector.py) runs it: your code for
every task you have written, the reference's for every task still raising "not implemented yet" (one
line names those tasks; `--strict` runs your code only). For each prompt it prints the largest logit
difference on the prompt's forward pass, the first generated token where the two differ with both
continuations from there, and the time ratio student / reference. The scheduler days (2.5 to 2.7)
also show how each side scheduled the work: prefill chunks and their sizes, decode steps, how many
shared an iteration with a chunk, and the longest stall of a decoding request; on the chunked-prefill
day the logit line compares your chunked prefill with the reference's one-shot prefill. Week 3's days
run both engines on one workload with a small KV pool and compare every step's plan, budget,
preemptions, blocks in use (and hit rate) and every token (scripts/compare_week3.py); days 4.1 and 4.2
do the same with your speculative engine (verify chunks, guesses accepted and rolled back) and your
quantized pools (blocks and bytes a memory budget buys), and day 4.5 with constrained requests (every step and
token, then your masks against the reference's along each constrained output) (scripts/compare_week4.py). Days without
a model-level run (attention, RoPE, metrics, ...) say so and give the test command instead.

Exit status: 0 when the student's run matches the reference; 1 when it differs or raises; 2 on bad
arguments.
"""

import argparse
import itertools
import re
import sys
import time
import traceback

from course import selector
from course.user_errors import command
from course.course_map import Day, find_day

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a cache that never misses.",
    "Explain chunked prefill in one sentence.",
]
WORKLOADS = ("model", "kv-cache", "batch", "chunked-prefill", "engine")  # the values of Day.compare, besides ""
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
    parser.add_argument("--loop", choices=["pipelined", "plain"], default="pipelined",
                        help="day 2.1: generate with the pipelined loop (Task 4, default) or the plain one (Task 3)")
    parser.add_argument("--batch-size", type=int, default=2, help="decode slots for batch days (default 2)")
    parser.add_argument("--prefill-step", type=int, default=None,
                        help="prefill chunk for batch days (default: whole prompts; 8 on the chunked-prefill day)")
    parser.add_argument("--strict", action="store_true",
                        help="your code only: no task taken from the reference (an unwritten one stops the run)")
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

    if kind == "model":
        generate = package.generate.simple_generate
    elif args.loop == "plain":
        generate = package.generate.simple_generate_with_kv_cache
    else:
        generate = package.generate.pipelined_generate_with_kv_cache
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
        # Up to the first EOS: the pipelined loop samples one more token, in the step it queued on EOS and drops.
        tokens = list(itertools.takewhile(lambda t: t not in tokenizer.eos_token_ids, sampler.tokens))
        if not sampler.tokens and text:
            tokens = tokenizer.encode(text, add_special_tokens=False)  # the sampler was not used
        runs.append((tokens, text, seconds))
    return runs


class CallLog:
    """Wraps a model and notes each call, ("prefill", chunk tokens) or ("decode", rows), and its logits."""

    def __init__(self, model):
        self.model, self.calls, self.outputs = model, [], []

    def __call__(self, inputs, offset, cache, **kwargs):
        self.calls.append(("prefill", inputs.shape[1]) if isinstance(offset, int) else ("decode", inputs.shape[0]))
        logits = self.model(inputs, offset, cache, **kwargs)
        self.outputs.append(logits)
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


def chunking(calls: list[tuple[str, int]]) -> dict:
    """What a call log says about scheduling: chunk sizes, decode steps, interleaving, the longest stall."""
    chunks = [n for kind, n in calls if kind == "prefill"]
    decodes = sum(kind == "decode" for kind, _ in calls)
    interleaved = sum(1 for before, now in zip(calls, calls[1:]) if now[0] == "decode" and before[0] == "prefill")
    # The longest stall, in prompt tokens: how many a decoding request waited through between two of its steps.
    stall, waited, decoding = 0, 0, False
    for kind, n in calls:
        if kind == "prefill":
            waited += n
        else:
            if decoding:
                stall = max(stall, waited)
            waited, decoding = 0, True
    return {"chunks": chunks, "decode_steps": decodes, "interleaved": interleaved, "stall_tokens": stall}


def sizes(chunks: list[int]) -> str:
    """'8 x 5, 3, 8 x 2': runs of equal chunk sizes."""
    runs = []
    for size in chunks:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return ", ".join(f"{size} x {count}" if count > 1 else f"{size}" for size, count in runs) or "-"


def batch_settings(kind, tokenizer, prompts, args) -> tuple[int, int]:
    """(prefill_step, max_seq_len) of a batch day's run."""
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    step = args.prefill_step or (8 if kind == "chunked-prefill" else max(lengths))
    return step, max(lengths) + args.max_tokens


def generate_batch(kind, package, model, tokenizer, prompts, args, ref):
    """The prompts through one SlotScheduler, as batch_generate runs it: per prompt (token ids, text, seconds); the schedule."""
    step, max_seq_len = batch_settings(kind, tokenizer, prompts, args)
    times = []
    for _ in range(max(1, args.repeat)):
        logged = CallLog(model)
        metrics = ref.metrics.MetricsRecorder()  # the reference's recorder times both sides
        scheduler = package.batch.SlotScheduler(logged, tokenizer, max_seq_len=max_seq_len, batch_size=args.batch_size,
                                            prefill_step=step, metrics=metrics, log=lambda line: None)
        started = time.perf_counter()
        for idx, prompt in enumerate(prompts):
            scheduler.add_request(prompt, idx)
        while scheduler.has_work():
            scheduler.step()
        times.append(time.perf_counter() - started)
    seconds = min(times)
    done = {r.prompt_idx: r for r in scheduler.finished}
    runs = [(list(done[i].output_tokens), done[i].text(), seconds / len(prompts)) if i in done else ([], "", 0.0)
            for i in range(len(prompts))]
    schedule = chunking(logged.calls)
    schedule["stall_s"] = metrics.summary()["longest_stall_s"]
    schedule["seconds"] = seconds
    return runs, schedule


def chunked_prefill_logits(package, model, tokenizer, prompt: str, step: int):
    """The logits of every prompt position as `Request.try_prefill` computes them, chunk by chunk."""
    import mlx.core as mx

    logged = CallLog(model)
    request = package.batch.Request(logged, tokenizer, prompt, prefill_max_step=step)
    while not request.is_prefill_done:
        request.try_prefill()
    return mx.concatenate(logged.outputs, axis=1)


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

    if day.compare == "engine" and day.week == 4:
        from scripts.compare_week4 import compare_week4

        return compare_week4(args, day, explain_failure)
    if day.compare == "engine":
        from scripts.compare_week3 import compare_engines

        return compare_engines(args, day, explain_failure)
    mine, ref = selector.for_command("student", strict=args.strict), selector.reference()
    if is_embedded(resolve_model(args.model)):
        print(MEANINGLESS_NOTE)
    mlx_model, tokenizer = load_model(args.model)
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.prompt is None and getattr(tokenizer, "chat_template", None):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    kind = day.compare
    batched = kind in ("batch", "chunked-prefill")
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    print(f"week {day.week} day {day.day}: {day.title}. Yours: src/tiny_llm; reference: src_ref/tiny_llm_ref.")
    if batched:
        step, max_seq_len = batch_settings(kind, tokenizer, prompts, args)
        print(f"workload: {kind}, {len(prompts)} prompts of {'/'.join(map(str, lengths))} tokens, each generating "
              f"until EOS or {max_seq_len} tokens in all (prompt + output); {args.batch_size} decode slots, "
              f"prefill chunks of {step} tokens{' (no chunking: a chunk holds every prompt)' if step >= max(lengths) else ''}; "
              f"model {args.model}\n")
    else:
        print(f"workload: {kind}, {len(prompts)} prompts of {'/'.join(map(str, lengths))} tokens, "
              f"{args.max_tokens} new tokens each (fewer at EOS), model {args.model}\n")

    problems = 0
    try:
        ref_model = build_model(kind, ref, mlx_model)
        my_model = student(day, build_model, kind, mine, mlx_model)
        if kind == "model":
            model_is_theirs = bool({"qwen2_week1", "embedding"} & set(day.modules))
        else:
            model_is_theirs = bool({"qwen2_week2", "kv_cache"} & set(day.modules))
        if batched:
            mine.batch, mine.metrics, mine.chunk_policy  # noqa: B018 - import now, so the line below is complete
        selector.announce(mine, file=sys.stdout)

        logit_gaps = []
        for prompt, length in zip(prompts, lengths):
            ids = mx.array([tokenizer.encode(prompt, add_special_tokens=False)])
            expected = forward(kind, ref_model, ids)
            if kind == "chunked-prefill":
                got = student(day, chunked_prefill_logits, mine, my_model, tokenizer, prompt, step)
            elif batched and not model_is_theirs:
                logit_gaps.append(None)  # the model is the reference's: nothing of yours to compare here
                continue
            else:
                got = student(day, forward, kind, my_model, ids)
            if got.shape != expected.shape:
                raise StudentFailed(f"your logits have shape {tuple(got.shape)}, the reference's {tuple(expected.shape)}")
            gap = mx.max(mx.abs(got.astype(mx.float32) - expected.astype(mx.float32))).item()
            agree = mx.sum(mx.argmax(got, axis=-1) == mx.argmax(expected, axis=-1)).item()
            logit_gaps.append((gap, agree, length))

        if not batched:
            ref_runs = generate_each(kind, ref, ref_model, tokenizer, prompts, args)
            my_runs = student(day, generate_each, kind, mine, my_model, tokenizer, prompts, args)
            schedules = None
        else:
            ref_runs, ref_schedule = generate_batch(kind, ref, ref_model, tokenizer, prompts, args, ref)
            my_runs, my_schedule = student(day, generate_batch, kind, mine, my_model, tokenizer, prompts, args, ref)
            schedules = (my_schedule, ref_schedule)
    except StudentFailed as failed:
        print(f"your code raised: {failed}")
        return 1

    what = ("your chunked prefill (Request.try_prefill) vs the reference's one-shot prefill"
            if kind == "chunked-prefill" else "the prompt's forward pass")
    for index, (prompt, logits, ref_run, my_run) in enumerate(zip(prompts, logit_gaps, ref_runs, my_runs), start=1):
        (ref_tokens, ref_text, ref_s), (my_tokens, my_text, my_s) = ref_run, my_run
        print(f"prompt {index} ({lengths[index - 1]} tokens): "
              f"{show(args.prompt[index - 1] if args.prompt else DEFAULT_PROMPTS[index - 1])}")
        diverge = first_difference(my_tokens, ref_tokens)
        if logits is not None:
            gap, agree, length = logits
            problems += gap > LOGIT_TOLERANCE
            note = "" if model_is_theirs or kind == "chunked-prefill" else "  (the model is the reference's on this day)"
            later = ("; the tokens below part later, in decoding" if diverge is not None and gap <= LOGIT_TOLERANCE
                     else "")
            print(f"  largest logit difference, {what}: {gap:.2e}; next-token choice agrees at "
                  f"{agree}/{length} positions{note}{later}")
        if diverge is None:
            print(f"  generated tokens: identical ({len(ref_tokens)} tokens)")
        else:
            problems += 1
            shared = tokenizer.decode(ref_tokens[max(0, diverge - CONTEXT_TOKENS):diverge])
            print(f"  generated tokens: first difference at token {diverge} (yours {len(my_tokens)} tokens, "
                  f"the reference {len(ref_tokens)}){f', after {show(shared)}' if shared else ''}")
            print(f"    reference continues: {show(tokenizer.decode(ref_tokens[diverge:]))}")
            print(f"    yours continues:     {show(tokenizer.decode(my_tokens[diverge:]))}")
        if schedules is None:
            print(f"  time: yours {my_s:.3f} s, reference {ref_s:.3f} s, ratio {my_s / max(ref_s, 1e-9):.2f}")
    if schedules is not None:
        print_schedules(*schedules)
    if args.temp > 0:
        print("\n(sampling with temperature draws random numbers: equal results need the same draws in the same order)")
    print(f"\n{'your run matches the reference' if not problems else 'your run differs from the reference'}")
    return 1 if problems else 0


def print_schedules(mine: dict, ref: dict) -> None:
    """The two schedules side by side: chunks, decode steps, interleaving, the longest stall, the time."""
    def stall_s(schedule):
        return "-" if schedule["stall_s"] is None else f"{schedule['stall_s'] * 1000:.0f} ms"

    rows = [
        ("prefill chunks", len(mine["chunks"]), len(ref["chunks"])),
        ("chunk sizes (tokens)", sizes(mine["chunks"]), sizes(ref["chunks"])),
        ("prompt tokens prefilled", sum(mine["chunks"]), sum(ref["chunks"])),
        ("decode steps", mine["decode_steps"], ref["decode_steps"]),
        ("decode steps sharing an iteration with a chunk", mine["interleaved"], ref["interleaved"]),
        ("longest stall of a decoding request (prompt tokens)", mine["stall_tokens"], ref["stall_tokens"]),
        ("longest stall of a decoding request (time)", stall_s(mine), stall_s(ref)),
        ("time, all prompts together", f"{mine['seconds']:.3f} s", f"{ref['seconds']:.3f} s"),
    ]
    width = max(len(label) for label, _, _ in rows)
    column = max(12, *(len(str(m)) for _, m, _ in rows))
    print(f"\nscheduling\n  {'':{width}s}  {'yours':{column}s}  reference")
    for label, m, r in rows:
        print(f"  {label:{width}s}  {str(m):{column}s}  {r}")
    print(f"  time ratio yours / reference: {mine['seconds'] / max(ref['seconds'], 1e-9):.2f}")


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
