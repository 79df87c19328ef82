"""Serve a model over an OpenAI-compatible HTTP API: week 3's engine behind day 3.5's server.

    pdm run serve                                   # reference solution, embedded model, port 8000
    pdm run serve --model bench-0.5b --port 8123
    pdm run serve --solution student                # your src/tiny_llm (server and engine)
    pdm run serve --max-num-batched-tokens 128 --max-num-seqs 8 --block-size 16 --num-blocks 512

Then, from another shell:

    curl -N localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": true}'
    curl localhost:8000/metrics
    pdm run bench-serve --base-url http://localhost:8000
"""

import argparse
import sys

from course import fast_mlx, selector
from course.user_errors import OneLineParser, user_error


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pdm run serve", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    selector.add_arguments(parser)
    parser.add_argument("--model", default=None,
                        help="default: smollm2-135m once fetched (`pdm run models fetch smollm2-135m`), else embedded; "
                             "or bench-0.5b, a checkpoint directory or a Hugging Face id")
    parser.add_argument("--served-model-name", default=None,
                        help="the id clients send as \"model\" (default: the --model argument)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="the token budget of one engine step (default 256)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="most sequences running at once (default 16)")
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (default 16)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: 8192 tokens' worth)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prompt blocks (day 3.3)")
    parser.add_argument("--log-interval", type=float, default=5.0,
                        help="seconds between the engine's throughput lines (default 5)")
    return parser


def positive(parser, name: str, value) -> None:
    if value is not None and value < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")


@selector.command
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("port", "max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks"):
        positive(parser, name, getattr(args, name))
    blas = fast_mlx.setup()
    import mlx.core as mx
    import uvicorn

    from course.models import MEANINGLESS_NOTE, default_model, describe_model, is_embedded, load_model, resolve_model

    selection = selector.from_arguments(args)
    try:
        args.model = default_model() if args.model is None else args.model
        path = resolve_model(args.model)
        mlx_model, tokenizer = load_model(args.model)
    except (ValueError, TypeError) as error:
        return user_error(parser.prog, str(error))
    qwen2_week3, engine_module, sequence, server = (selection.qwen2_week3, selection.engine, selection.sequence,
                                                    selection.server)
    log = lambda line: print(f"[engine] {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        model = qwen2_week3.Qwen2ModelWeek3(mlx_model)
        # MLX streams are thread-local: whatever the model left lazy on this thread must be evaluated
        # here, before the engine thread takes over. One tiny generation does that (and warms up).
        engine_module.generate(model, tokenizer, [[0]], sequence.SamplingParams(max_tokens=1))
        config = engine_module.EngineConfig(
            token_budget=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
            num_blocks=args.num_blocks, log_interval=args.log_interval, enable_prefix_caching=args.enable_prefix_caching)
        engine = engine_module.LLMEngine(model, tokenizer, config, log=log)
        name = args.served_model_name or args.model
        app = server.create_app(engine, tokenizer, name)
    except (ValueError, TypeError) as error:
        return user_error(parser.prog, str(error))
    selector.announce(selection)
    print(f"[tiny-llm] model {describe_model(path)}", file=sys.stderr)
    print(f"[tiny-llm] serving {path} as {name!r} with the {args.solution} solution ({selection.package}) on "
          f"http://{args.host}:{args.port}; device {mx.default_device()}{'; BLAS ' + blas if blas else ''}",
          file=sys.stderr)
    if is_embedded(path):
        print(MEANINGLESS_NOTE, file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
