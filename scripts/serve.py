"""Serve a model over an OpenAI-compatible HTTP API: week 3's engine behind day 3.5's server.

    pdm run serve                                   # reference solution, embedded model, port 8000
    pdm run serve --model bench-0.5b --port 8123
    pdm run serve --solution student                # your src/tiny_llm (server and engine)
    pdm run serve --max-num-batched-tokens 128 --max-num-seqs 8 --block-size 16 --num-blocks 512
    pdm run serve --target-itl 0.2 --scheduling-policy priority --api-key sesame --log-level warning

Then, from another shell:

    curl -N localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": true}'
    curl localhost:8000/metrics
    pdm run bench-serve --base-url http://localhost:8000
"""

import argparse
import logging
import socket
import sys

import uvicorn

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
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached prompt blocks (day 3.3; on by default, as vLLM)")
    parser.add_argument("--adaptive-budget", action="store_true",
                        help="day 3.1's adaptive token budget, up to --max-num-batched-tokens (default: fixed)")
    parser.add_argument("--target-itl", type=float, default=None, metavar="SECONDS",
                        help="the adaptive budget's inter-token latency target (implies --adaptive-budget)")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="fcfs, or priority: requests' `priority` field, lower first (day 3.4)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens (prompt + output) of one request (default: what the KV pool and model hold)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 requests")
    parser.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                        help="origins browsers may call the API from (CORS); '*' for any (default: none)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="info logs every request (the access log); warning only problems (default info)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="on Ctrl-C or SIGTERM, seconds to let running requests finish before they are "
                             "aborted (default 5)")
    parser.add_argument("--log-interval", type=float, default=5.0,
                        help="seconds between the engine's throughput lines (default 5)")
    return parser


def positive(parser, name: str, value) -> None:
    if value is not None and not value > 0:
        parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")


def check_port(parser, host: str, port: int) -> None:
    """The address must be one this process can listen on: checked before the model loads, not after."""
    if not 1 <= port <= 65535:
        parser.error(f"--port must be in 1 .. 65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        parser.error(f"cannot listen on {host}:{port}: {error.strerror or error}")


@selector.command
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_blocks", "target_itl", "max_model_len"):
        positive(parser, name, getattr(args, name))
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    check_port(parser, args.host, args.port)
    try:
        return serve(parser, args)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (once serving, uvicorn handles it)
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


def serve(parser, args) -> int:
    """Load the model, build the engine and the app, and serve until Ctrl-C or SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(name)s] %(message)s", stream=sys.stderr)
    blas = fast_mlx.setup()
    import mlx.core as mx

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
        engine = make_engine(args, selection, model, tokenizer, log)
        name = args.served_model_name or args.model
        app = server.create_app(engine, tokenizer, name, max_model_len=args.max_model_len, api_key=args.api_key,
                                cors_origins=tuple(args.allowed_origins))
    except (ValueError, TypeError) as error:
        return user_error(parser.prog, str(error))
    selector.announce(selection)
    print(f"[tiny-llm] model {describe_model(path)}", file=sys.stderr)
    print(f"[tiny-llm] serving {path} as {name!r} with the {args.solution} solution ({selection.package}) on "
          f"http://{args.host}:{args.port}; device {mx.default_device()}{'; BLAS ' + blas if blas else ''}",
          file=sys.stderr)
    if is_embedded(path):
        print(MEANINGLESS_NOTE, file=sys.stderr)
    # Its own access log is off: ours (tiny_llm.access) has the timing and the request id.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    DrainingServer(config, args.shutdown_timeout).run()
    print("[tiny-llm] stopped", file=sys.stderr)
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but on Ctrl-C or SIGTERM the app drains first: new requests get a 503, running
    ones get `timeout` seconds to finish, then end with finish reason "abort" (their blocks freed); only
    then does uvicorn close the connections and the app's lifespan stop the engine thread."""

    def __init__(self, config: uvicorn.Config, timeout: float):
        super().__init__(config)
        self.timeout = timeout

    async def shutdown(self, sockets=None):
        await self.config.app.state.drain(self.timeout)
        await super().shutdown(sockets)


def make_engine(args, selection, model, tokenizer, log):
    """The engine with every knob of the command line (the one place this command builds an engine)."""
    config = selection.engine.EngineConfig(
        token_budget=args.max_num_batched_tokens, adaptive_budget=args.adaptive_budget or args.target_itl is not None,
        target_itl=args.target_itl, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
        num_blocks=args.num_blocks, log_interval=args.log_interval, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy)
    return selection.engine.LLMEngine(model, tokenizer, config, log=log)


if __name__ == "__main__":
    sys.exit(main())
