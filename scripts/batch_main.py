"""Continuous batching with chunked prefill on a set of prompts, with a live view of the scheduler.

    pdm run batch-main                               # reference scheduler, SmolLM2 if fetched, else embedded
    pdm run batch-main --solution student            # your src/tiny_llm/batch.py (on the reference model)
    pdm run batch-main --prefill-step 16 --batch-size 2
    pdm run batch-main --adaptive 0.02               # chunk sizes from measured times, 20 ms target
    pdm run batch-main --model Qwen/Qwen2-0.5B-Instruct-MLX --max-tokens 64
    pdm run batch-main --no-live                     # a log line per iteration instead of the live panel

Each iteration of the scheduler runs one prefill chunk of the request being prefilled and one decode
step of every request in a decode slot. The live view shows, after every iteration: the queue, the
prefill in progress (how many prompt tokens are in its KV cache), each decode slot (request, position,
tokens so far, the end of its text), and what finished. At the end: every request's text, the serving
metrics of day 2.2 (TTFT, ITL, TPOT, end-to-end latency) and the scheduler's chunk statistics.
"""

import argparse
import logging
import sys
import time

from course import fast_mlx, selector
from course.user_errors import OneLineParser, command, user_error

PROMPTS = [
    "What is continuous batching?",
    "Explain chunked prefill in one sentence.",
    "Write a haiku about a KV cache.",
    "Summarize the following notes about serving large language models. " + " ".join(
        f"Note {i}: requests arrive at random times, prompts differ in length, and a long prompt's prefill "
        f"can stall every decode step behind it unless it is split into chunks." for i in range(1, 9)),
    "List three reasons to batch decode steps.",
    "Why is decoding memory-bandwidth bound?",
    "Translate 'good morning' into French.",
    "What does time to first token measure?",
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pdm run batch-main", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    selector.add_arguments(parser)
    parser.add_argument("--model", default=None,
                        help="default: smollm2-135m once fetched (`pdm run models fetch smollm2-135m`), else embedded; "
                             "or bench-0.5b, a checkpoint directory or a Hugging Face id")
    parser.add_argument("--batch-size", type=int, default=3, help="decode slots (default 3)")
    parser.add_argument("--prefill-step", type=int, default=32, help="prompt tokens per prefill chunk (default 32)")
    parser.add_argument("--adaptive", type=float, metavar="SECONDS",
                        help="size chunks with AdaptiveChunkPolicy for this decode-latency target (default: fixed)")
    parser.add_argument("--max-seq-len", type=int, default=512, help="prompt + output tokens per request (default 512)")
    parser.add_argument("--max-tokens", type=int, default=24, help="most tokens per request (default 24)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: 8 built-in prompts)")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompts as they are")
    parser.add_argument("--no-live", action="store_true", help="print a line per iteration instead of the live panel")
    parser.add_argument("--step-delay", type=float, default=None,
                        help="pause after each iteration, to watch (default 0.05 s in the live view, else 0)")
    return parser


def shorten(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else "…" + text[-(width - 1):]


def render(scheduler, iteration: int, elapsed: float) -> str:
    """The scheduler's state as a small text panel."""
    lines = [f"iteration {iteration:4d}   {elapsed:6.2f} s   {scheduler.policy.describe()}   "
             f"{scheduler.batch_size} decode slots of {scheduler.max_seq_len} tokens", ""]
    queue = " ".join(f"#{r.prompt_idx}({len(r.prompt_tokens)} tok)" for r in scheduler.queue)
    lines.append(f"queue    ({len(scheduler.queue)}): {queue or '-'}")
    pending = scheduler.prefilling
    if pending is None:
        lines.append("prefill     : -")
    else:
        total = len(pending.prompt_tokens)
        done = pending.offset
        bar = "#" * round(24 * done / total) + "." * (24 - round(24 * done / total))
        state = "waiting for a slot" if pending.is_prefill_done else f"next chunk at offset {done}"
        lines.append(f"prefill     : #{pending.prompt_idx} [{bar}] {done}/{total} prompt tokens, {state}")
    lines.append("decode slots:")
    for slot, request in enumerate(scheduler.slots):
        if request is None:
            lines.append(f"  [{slot}] idle")
            continue
        lines.append(f"  [{slot}] #{request.prompt_idx:<3d} position {request.offset:4d}  "
                     f"{len(request.output_tokens):3d} tokens  {shorten(request.text(), 40)!r}")
    finished = " ".join(f"#{r.prompt_idx}({r.finish_reason}, {len(r.output_tokens)})" for r in scheduler.finished)
    lines.append(f"finished ({len(scheduler.finished)}): {finished or '-'}")
    stats = scheduler.stats
    lines.append(f"\nchunks {stats.chunks} ({stats.prefill_tokens} prompt tokens), decode steps {stats.decode_steps} "
                 f"({stats.decode_tokens} tokens), interleaved {stats.interleaved_steps}")
    return "\n".join(lines)


def one_line(scheduler, iteration: int, elapsed: float) -> str:
    pending = scheduler.prefilling
    prefill = "-" if pending is None else f"#{pending.prompt_idx} {pending.offset}/{len(pending.prompt_tokens)}"
    slots = " ".join("." if r is None else f"#{r.prompt_idx}" for r in scheduler.slots)
    return (f"[{elapsed:7.2f} s] it {iteration:4d}  queue {len(scheduler.queue)}  prefill {prefill:>12s}  "
            f"slots [{slots}]  finished {len(scheduler.finished)}")


def set_up(args, selection: selector.Selection, live: bool, log_lines: list[str]):
    """Load the model, make the scheduler and queue every prompt: (scheduler, model directory).

    Bad input raises ValueError or TypeError, before any model call.
    """
    from course.models import default_model, load_model, resolve_model
    from tiny_llm_ref.validation import check_number, check_text

    if args.step_delay is not None:
        check_number("--step-delay", args.step_delay, 0.0)
    for prompt in args.prompt or []:
        if prompt:  # stray bytes on the command line arrive as lone surrogates: not valid UTF-8
            check_text("--prompt", prompt)
    args.model = default_model() if args.model is None else args.model
    path = resolve_model(args.model)
    mlx_model, tokenizer = load_model(args.model)
    model = selector.reference().qwen2_week2.Qwen2ModelWeek2(mlx_model)  # the scheduler runs on the reference model
    policy = None
    if args.adaptive is not None:  # not a truthiness test: --adaptive 0 is an error, not "fixed"
        policy = selection.chunk_policy.AdaptiveChunkPolicy(target_itl=args.adaptive)
    scheduler = selection.batch.SlotScheduler(model, tokenizer, max_seq_len=args.max_seq_len, batch_size=args.batch_size,
                                prefill_step=args.prefill_step, policy=policy,
                                log=log_lines.append if live else None, log_interval=2.0)
    for prompt in args.prompt or PROMPTS:
        if not args.no_chat_template and getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
        scheduler.add_request(prompt, max_tokens=args.max_tokens)
    return scheduler, path


@command
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    fast_mlx.setup()
    from course.models import MEANINGLESS_NOTE, describe_model, is_embedded
    from tiny_llm_ref.metrics import format_summary

    selection = selector.for_command(args.solution, args.strict)
    live = not args.no_live and sys.stdout.isatty()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    log_lines: list[str] = []
    try:
        scheduler, path = set_up(args, selection, live, log_lines)
    except (ValueError, TypeError) as error:
        return user_error(parser.prog, str(error))
    print(f"[tiny-llm] model {describe_model(path)}", file=sys.stderr)
    if is_embedded(path):
        print(MEANINGLESS_NOTE, file=sys.stderr)
    selector.announce(selection)
    delay = args.step_delay if args.step_delay is not None else (0.05 if live else 0.0)

    start = time.perf_counter()
    iteration = 0
    try:
        while scheduler.has_work():
            scheduler.step()
            iteration += 1
            elapsed = time.perf_counter() - start
            if live:
                print("\x1b[H\x1b[2J" + render(scheduler, iteration, elapsed) + "\n\n" + "\n".join(log_lines[-3:]),
                      flush=True)
            else:
                print(one_line(scheduler, iteration, elapsed), flush=True)
            if delay:
                time.sleep(delay)
    except BaseException:
        scheduler.release_all()
        raise

    print(f"\n{len(scheduler.finished)} requests in {time.perf_counter() - start:.2f} s, {iteration} iterations"
          + (f" (the live view paused {delay * 1000:.0f} ms per iteration; --step-delay 0 for real timings)"
             if delay else ""))
    for request in sorted(scheduler.finished, key=lambda r: r.prompt_idx):
        print(f"  #{request.prompt_idx} ({len(request.prompt_tokens)} prompt tokens, {request.finish_reason}): "
              f"{shorten(request.text(), 90)!r}")
    print("\nserving metrics (day 2.2):")
    print(format_summary(scheduler.metrics.summary()))
    stats = scheduler.stats
    avg = f"{stats.avg_chunk_time * 1000:.1f} ms" if stats.avg_chunk_time is not None else "-"
    ratio = f"{stats.interleave_ratio:.2f}" if stats.interleave_ratio is not None else "-"
    print(f"\nscheduler: {stats.chunks} prefill chunks (average {avg}), {stats.decode_steps} decode steps "
          f"serving {stats.decode_tokens} tokens, {stats.interleaved_steps} decode steps shared an iteration "
          f"with a chunk; prefill-to-decode ratio {ratio} chunks per decode step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
