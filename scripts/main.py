"""Generate text with the course's Qwen2: the reference solution by default, or yours.

    pdm run main                                   # reference solution, greedy, on SmolLM2 if fetched, else embedded
    pdm run main --solution student                # your src/tiny_llm
    pdm run main --solution student --week 1       # your week-1 model, without the KV cache
    pdm run main --model bench-0.5b --max-tokens 32
    pdm run main --temp 0.7 --top-p 0.9 --top-k 50 # sampling (day 1.7)
    pdm run main --model bench-0.5b --compare-mlx-lm   # also time mlx-lm on the same model and prompt
    pdm run main --compare-mlx-lm --rounds 3           # both sides 3 times, alternating; medians compared
    pdm run main --loop plain --compare-mlx-lm         # day 2.1's plain loop (Task 3) instead of the pipelined one

The text streams as it is generated; then come prompt tokens/s (prompt tokens over the time until the
first generated token reaches Python) and generation tokens/s (the tokens after the first over the time
from the first token's arrival to the last's, the rule mlx-lm's figure follows, except that mlx-lm also
counts the first token). A token arrives when the loop hands it to the tokenizer's streaming
detokenizer; nothing is evaluated early to time it, so week 2's pipelined loop (day 2.1 Task 4) keeps
its overlap. With --compare-mlx-lm, mlx-lm's own generation loop (`stream_generate`) runs on the same
model and prompt in the same process, timed by the same rule from the arrival of its tokens, and both
figures are printed side by side with their ratio (on a quantized checkpoint, mlx-lm runs twice: on the
weights as they are, and dequantized, the format ours computes in).
"""

import argparse
import os
import statistics
import sys
import time

from course import fast_mlx, selector
from course.user_errors import OneLineParser, command, user_error

DEFAULT_PROMPT = "Give me a short introduction to large language models."


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pdm run main", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    selector.add_arguments(parser)
    parser.add_argument("--model", default=None,
                        help="default: smollm2-135m once fetched (`pdm run models fetch smollm2-135m`), else embedded; "
                             "or bench-0.5b, a checkpoint directory or a Hugging Face id")
    parser.add_argument("--week", type=int, choices=[1, 2], default=2,
                        help="2: the KV-cache model and loop of day 2.1 (default); 1: week 1's cacheless loop")
    parser.add_argument("--loop", choices=["pipelined", "plain"], default="pipelined",
                        help="week 2's loop: pipelined (day 2.1 Task 4, default) or plain (Task 3)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep this much probability")
    parser.add_argument("--top-k", type=int, default=None, help="keep only the k most likely tokens")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as it is")
    parser.add_argument("--compare-mlx-lm", action="store_true",
                        help="also run mlx-lm's generation loop on the same model and prompt, and compare tokens/s")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --compare-mlx-lm: run both sides this many times, alternating, and compare "
                             "the medians (default 1)")
    return parser


def pick_generation(package: selector.Selection, week: int, loop: str = "pipelined"):
    """(build the model from an mlx-lm model, the generate function) for this package.

    Week 1: Qwen2ModelWeek1 and simple_generate (every step recomputes the whole sequence).
    Week 2: Qwen2ModelWeek2 and pipelined_generate_with_kv_cache (each step feeds only the new token,
    and is queued before the token before it is read), or with `loop="plain"` day 2.1's
    simple_generate_with_kv_cache (each step waits for the token before it).
    """
    generate = package.generate
    if week == 1:
        return package.qwen2_week1.Qwen2ModelWeek1, generate.simple_generate
    model = package.qwen2_week2.Qwen2ModelWeek2
    if loop == "plain":
        return model, generate.simple_generate_with_kv_cache
    return model, generate.pipelined_generate_with_kv_cache


class TimedTokenizer:
    """Wraps a tokenizer: its streaming detokenizers note the time each generated token reaches them.

    Every generation loop hands each token it keeps to `detokenizer.add_token` right after reading it,
    so these are the times tokens arrive in Python. Timing the model's calls instead would need an
    `mx.eval` after each (MLX is lazy), which would undo the pipelined loop's overlap.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.arrivals: list[float] = []

    @property
    def detokenizer(self):
        detokenizer = self.tokenizer.detokenizer  # a fresh one, as the tokenizer's property gives
        add_token = detokenizer.add_token

        def timed_add_token(token):
            self.arrivals.append(time.perf_counter())
            add_token(token)

        detokenizer.add_token = timed_add_token
        return detokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def rates(prompt_tokens: int, start: float, arrivals: list[float]) -> dict:
    """Prompt and generation tokens/s from the start time and each generated token's arrival time."""
    prompt_tps = prompt_tokens / (arrivals[0] - start) if arrivals else 0.0
    gaps = len(arrivals) - 1
    generation_tps = gaps / (arrivals[-1] - arrivals[0]) if gaps > 0 else 0.0
    return {"prompt_tokens": prompt_tokens, "prompt_tps": prompt_tps, "generated": len(arrivals),
            "generation_tps": generation_tps}


def make_our_sampler(package: selector.Selection, args):
    """None (greedy) at temperature 0 without filters, else the package's own make_sampler (day 1.7)."""
    if args.temp == 0 and args.top_p is None and args.top_k is None:
        return None
    return package.sampler.make_sampler(args.temp, top_p=args.top_p, top_k=args.top_k)


def warmed_up(ours, week: int):
    """`ours` after one token through it, untimed: the weights it copied are lazy (a quantized checkpoint's are
    dequantized on first use), and the prompt's time should not include making them."""
    import mlx.core as mx

    one_token = mx.array([[0]])
    mx.eval(ours(one_token) if week == 1 else ours(one_token, 0, ours.make_cache()))
    return ours


def print_piece(piece: str) -> None:
    print(piece, end="", flush=True)


def run_ours(ours, generate, tokenizer, prompt: str, args, sampler, show: bool) -> dict:
    timed = TimedTokenizer(tokenizer)
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    start = time.perf_counter()
    generate(ours, timed, prompt, sampler=sampler, max_tokens=args.max_tokens, on_text=print_piece if show else None)
    if show:
        print()
    return rates(prompt_tokens, start, timed.arrivals)


def run_mlx_lm(model, tokenizer, prompt: str, args, show: bool) -> dict:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    # mlx-lm's top-k needs k below the vocabulary size; ours keeps every token for a k at least that.
    top_k = min(args.top_k, model.args.vocab_size - 1) if args.top_k else 0
    sampler = make_sampler(args.temp, top_p=args.top_p or 0.0, top_k=top_k)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    arrivals = []
    start = time.perf_counter()
    for response in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens, sampler=sampler):
        if response.finish_reason != "stop":  # each response brings one token; a "stop" one brings EOS, not output
            arrivals.append(time.perf_counter())
        if show:
            print(response.text, end="", flush=True)
    if show:
        print()
    return rates(len(ids), start, arrivals)


def mlx_lm_peers(model, args) -> dict:
    """The mlx-lm models to time beside ours: the one loaded, and a dequantized copy when it is quantized.

    Ours dequantizes a quantized checkpoint once at load; mlx-lm keeps it quantized, and MLX's CPU quantized
    kernels are slow. The same format on both sides is the fair comparison, so both are timed.
    """
    import mlx.core as mx

    from course.models import load_model

    peers = {"mlx-lm": model}
    if is_quantized(model):
        from mlx_lm.utils import dequantize_model

        copy, _ = load_model(args.model)
        peers["mlx-lm dequantized"] = dequantize_model(copy)
    for peer in peers.values():
        mx.eval(peer.parameters())
        mx.eval(peer(mx.array([[0]])))  # one warm-up token, so the first timed run pays no start-up costs
    return peers


def check_args(args) -> None:
    """Raise ValueError or TypeError for flags out of range, before anything is loaded."""
    from tiny_llm_ref.validation import check_int, check_sampling, check_text

    check_int("--max-tokens", args.max_tokens, 1)
    check_int("--rounds", args.rounds, 1)
    check_sampling(args.temp, args.top_p, args.top_k)
    if args.prompt:  # stray bytes on the command line arrive as lone surrogates: not valid UTF-8
        check_text("--prompt", args.prompt)


@command
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    blas = fast_mlx.setup()
    import mlx.core as mx

    from course.models import (MEANINGLESS_NOTE, build_prompt, default_model, describe_model, is_embedded, load_model,
                               resolve_model)
    from tiny_llm_ref.validation import check_text

    package = selector.for_command(args.solution, args.strict)
    try:
        check_args(args)
        args.model = default_model() if args.model is None else args.model
        path = resolve_model(args.model)
        model, tokenizer = load_model(args.model)
        prompt = build_prompt(tokenizer, args.prompt, not args.no_chat_template)
        check_text("prompt", prompt)  # empty without a chat template
    except (ValueError, TypeError) as error:
        return user_error(parser.prog, str(error))
    print(f"[tiny-llm] model {describe_model(path)}", file=sys.stderr)
    # Loading can leave the weights lazy (a float32 cast on the CPU is only recorded): materialize them
    # now, so that neither timed run pays for the conversion.
    mx.eval(model.parameters())
    print(f"[tiny-llm] {args.solution} solution ({package.package}); device {mx.default_device()}"
          f"{'; BLAS ' + blas if blas else ''}", file=sys.stderr)
    if is_embedded(path):
        print(MEANINGLESS_NOTE, file=sys.stderr)

    model_class, generate = pick_generation(package, args.week, args.loop)
    sampler = make_our_sampler(package, args)
    selector.announce(package)
    ours = warmed_up(model_class(model), args.week)
    peers = mlx_lm_peers(model, args) if args.compare_mlx_lm else {}
    runs = {package.package: [], **{name: [] for name in peers}}
    if args.compare_mlx_lm:
        print(f"[tiny-llm] {args.rounds} round(s), each: ours, then {', then '.join(peers)}; "
              f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    # Alternating the sides in rounds spreads a busy machine's ups and downs over both.
    for round_number in range(args.rounds):
        show = round_number == 0  # the text once; later rounds only time
        runs[package.package].append(run_ours(ours, generate, tokenizer, prompt, args, sampler, show))
        print_rates(package.package, runs[package.package][-1])
        for name, peer in peers.items():
            if show:
                print(f"--- {name} (mlx_lm.stream_generate, with its KV cache) on the same prompt:")
            runs[name].append(run_mlx_lm(peer, tokenizer, prompt, args, show))
            print_rates(name, runs[name][-1])
    if args.compare_mlx_lm:
        ours_median = medians(runs[package.package])
        if args.rounds > 1:
            print_rates(f"{package.package}, median of {args.rounds}", ours_median)
        for name in peers:
            theirs = medians(runs[name])
            if args.rounds > 1:
                print_rates(f"{name}, median of {args.rounds}", theirs)
            print_ratio(name, ours_median, theirs)
    return 0


def print_rates(name: str, run: dict) -> None:
    print(f"[{name}] prompt: {run['prompt_tokens']} tokens, {run['prompt_tps']:.1f} tokens/s; "
          f"generation: {run['generated']} tokens, {run['generation_tps']:.2f} tokens/s")


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (the token counts are the same in every run of one side)."""
    return {**runs[0], **{key: statistics.median(run[key] for run in runs) for key in ("prompt_tps", "generation_tps")}}


def is_quantized(model) -> bool:
    """True when any layer of the mlx-lm model keeps quantized weights."""
    import mlx.nn as nn

    return any(isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, module in model.named_modules())


def print_ratio(peer: str, ours: dict, theirs: dict) -> None:
    """One line: our prompt and generation tokens/s over the peer's."""
    ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
    print(f"ours / {peer}: prompt {ratio(ours['prompt_tps'], theirs['prompt_tps']):.2f}x, "
          f"generation {ratio(ours['generation_tps'], theirs['generation_tps']):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
