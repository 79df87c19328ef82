"""Serve a model over an OpenAI-compatible HTTP API: week 3's engine behind day 3.5's server.

    pdm run serve                                   # reference solution, embedded model, port 8000
    pdm run serve --model bench-0.5b --port 8123
    pdm run serve --solution student                # your src/tiny_llm (server and engine)
    pdm run serve --token-budget 128 --max-num-seqs 8 --block-size 16 --num-blocks 512
    pdm run serve --target-itl 0.2 --target-ttft 2 --scheduling-policy priority --api-key sesame --log-level warning
    pdm run serve --budget-policy fixed --scheduling-policy fcfs   # day 3.1's plain engine
    pdm run serve --tensor-parallel 2               # day 4.4: two ranks on this machine (mlx.launch), HTTP on rank 0
    pdm run serve --hostfile hosts.json             # day 4.4: one rank per host of mlx.launch's hostfile

The engine's knobs default to `EngineConfig`'s defaults (src_ref/tiny_llm_ref/engine.py), the configuration
the week-3 lab recommends (`pdm run bench-token-budget`): each --help line below names the default.

Then, from another shell:

    curl -N localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": true}'
    curl localhost:8000/metrics
    pdm run bench-serve --base-url http://localhost:8000
"""

import argparse
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys

import uvicorn

from course import fast_mlx, ranks, selector
from course.user_errors import OneLineParser, command, user_error


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
    add_engine_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens (prompt + output) of one request (default: what the KV pool and model hold)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 requests")
    parser.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                        help="origins browsers may call the API from (CORS); '*' for any (default: none)")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 2**20, metavar="BYTES",
                        help="a larger request body gets a 413 before it is parsed (default 8 MiB)")
    parser.add_argument("--max-pending-requests", type=int, default=256, metavar="N",
                        help="engine requests (choices) in flight; beyond them a 429 with Retry-After (default 256)")
    parser.add_argument("--keepalive", type=float, default=5.0, metavar="SECONDS",
                        help="a stream silent this long gets an SSE comment line (default 5)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="info logs every request (the access log); warning only problems (default info)")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="on Ctrl-C or SIGTERM, seconds to let running requests finish before they are "
                             "aborted (default 5)")
    parser.add_argument("--log-interval", type=float, default=None, metavar="SECONDS",
                        help="seconds between the engine's throughput lines (default "
                             f"{engine_defaults()['log_interval']:g})")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="day 4.4: run the model on N ranks of this machine, started with mlx.launch; the HTTP "
                             "server on rank 0 (default 1: one process; with --hostfile, one rank per host)")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="day 4.4: put the ranks on these hosts (mlx.launch's JSON hostfile, ring backend; the "
                             "same repository path, environment and model on each); rank 0 on the first host")
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)  # set by the launch itself
    return parser


def engine_defaults() -> dict:
    """`EngineConfig`'s defaults, by field name: the one place they are stated is the reference's engine.py."""
    fast_mlx.setup()  # before the reference's engine imports mlx.core
    config = selector.reference().engine.EngineConfig
    return {field.name: field.default for field in dataclasses.fields(config)}


def add_engine_arguments(parser) -> None:
    """The engine's knobs; left out, each is `EngineConfig`'s default (what the labs recommend), named in its help."""
    default = engine_defaults()
    parser.add_argument("--token-budget", "--max-num-batched-tokens", dest="token_budget", type=int, default=None,
                        metavar="TOKENS",
                        help="the most tokens one engine step runs, decodes and prefill chunks together (vLLM's "
                             "--max-num-batched-tokens); the cap of every budget policy (default "
                             f"{default['token_budget']}: with nobody streaming, a long prompt prefills in chunks "
                             "this big)")
    parser.add_argument("--budget-policy", choices=("fixed", "adaptive", "goodput"), default=None,
                        help=f"how many of those tokens a step may run (default {default['budget_policy']}: day "
                             "3.4's budget, sized from measured step times to keep both --target-itl and "
                             "--target-ttft); adaptive: day 3.1's, every step held to --target-itl; fixed: always "
                             "--token-budget")
    parser.add_argument("--target-itl", type=float, default=None, metavar="SECONDS",
                        help="the inter-token latency promised to streaming requests: no step is planned longer "
                             f"(default: {default['decode_multiple']:g} decode-only steps, as measured; adaptive "
                             "and goodput budgets)")
    parser.add_argument("--target-ttft", type=float, default=None, metavar="SECONDS",
                        help="the time to first token aimed for: as the longest-waiting request nears it, prefill "
                             f"gets more of each step (default: {default['ttft_multiple']:g} decode-only steps, as "
                             "measured; goodput budget)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"most sequences running at once, prefilling or decoding (default "
                             f"{default['max_num_seqs']}: more share each step's weight reads, each costs KV blocks)")
    parser.add_argument("--block-size", type=int, default=None,
                        help=f"KV-cache block size in tokens (default {default['block_size']}: vLLM's; the prefix "
                             "cache shares whole blocks)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV-cache blocks (default: 8192 tokens' worth)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse cached prompt blocks (day 3.3; default "
                             f"{'on' if default['enable_prefix_caching'] else 'off'}, as vLLM: shared system "
                             "prompts are prefilled once)")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority", "shortest_prefill_first"), default=None,
                        help=f"the order of the waiting and running (default {default['scheduling_policy']}: "
                             "priority, then the fewest prompt tokens left, so a short prompt passes a long one's "
                             "chunks; day 3.4); priority: requests' `priority` field, larger first (vLLM's is lower "
                             "first); fcfs: first come, first served")


def server_options(args) -> dict:
    """`create_app`'s keyword arguments from the command line."""
    return {"max_model_len": args.max_model_len, "api_key": args.api_key, "cors_origins": tuple(args.allowed_origins),
            "max_body_bytes": args.max_body_bytes, "max_pending_requests": args.max_pending_requests,
            "keepalive": args.keepalive}


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


@command
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("token_budget", "max_num_seqs", "block_size", "num_blocks", "target_itl", "target_ttft",
                 "max_model_len", "max_body_bytes", "max_pending_requests", "keepalive", "log_interval"):
        positive(parser, name, getattr(args, name))
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be at least 0, got {args.shutdown_timeout}")
    positive(parser, "tensor_parallel", args.tensor_parallel)
    world_size = ranks_wanted(parser, args)
    if world_size > 1 and not args.as_rank:
        check_port(parser, args.host, args.port)
        return launch_ranks(parser.prog, world_size, args.hostfile, sys.argv[1:] if argv is None else argv)
    if not args.as_rank:
        check_port(parser, args.host, args.port)
    try:
        if args.as_rank:
            return serve_rank(parser, args)
        return serve(parser, args)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (once serving, uvicorn handles it)
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130


def ranks_wanted(parser, args) -> int:
    """How many ranks: --tensor-parallel, or the hostfile's hosts (which --tensor-parallel, if given, must match)."""
    if args.hostfile is None or args.as_rank:
        return args.tensor_parallel or 1
    try:
        hosts = ranks.read_hostfile(args.hostfile)
    except ValueError as error:
        raise SystemExit(user_error(parser.prog, str(error))) from None
    if args.tensor_parallel not in (None, len(hosts)):
        parser.error(f"--tensor-parallel {args.tensor_parallel} but the hostfile names {len(hosts)} hosts")
    return len(hosts)


def launch_ranks(prog: str, world_size: int, hostfile: str | None, argv: list[str]) -> int:
    """This command again on `world_size` ranks (of this machine, or one per host), under mlx.launch.

    mlx.launch exits 0 even when a rank fails, so its output is read on the way through: a rank that
    died (at start-up or later) ends this command with one line naming it and its last line, and a
    non-zero status. Ctrl-C: rank 0's server drains and stops the other ranks, which (like mlx.launch)
    ignore it.
    """
    program = [sys.executable, "-m", "scripts.serve", *argv, "--as-rank"]
    # One BLAS thread per rank; and pdm's import paths, which a rank started through ssh would not inherit.
    env = {name: "1" for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    command = ranks.launch_command(program, world_size, hostfile, env=env)
    ignore_ctrl_c = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 - rank 0's server re-enables it
    # Rank 0's server stops on Ctrl-C whatever this process inherited (a shell's background job starts with
    # SIGINT ignored, and uvicorn sets its own handler): so does this launcher, which then reports it (130).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    process = subprocess.Popen(command, env={**os.environ, **env}, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=ignore_ctrl_c)
    watch, interrupted = ranks.LaunchWatch(), False
    while True:
        try:
            watch.follow(process.stderr, sys.stderr)  # until every rank has ended
            break
        except KeyboardInterrupt:
            interrupted = True  # rank 0 drains, then stops the others: keep reading
    process.wait()
    if watch.failure():
        user_error(prog, f"{watch.failure()}; every rank stopped")
        return watch.exit_status
    return 130 if interrupted else process.returncode


def serve_rank(parser, args) -> int:
    """One rank of `--tensor-parallel N`: rank 0 serves HTTP over a `TensorParallelEngine`; the others follow it."""
    fast_mlx.setup()  # before mlx.core is imported (by join)
    group = ranks.join()  # then every line this rank writes to stderr names it, the log's too
    logging.basicConfig(level=args.log_level.upper(), format="[%(name)s] %(message)s", stream=sys.stderr)
    from course.models import load_model

    selection = selector.for_command(args.solution, args.strict)
    try:
        mlx_model, tokenizer = load_model(default_model_name(args))
        model = selection.tensor_parallel.Qwen2TensorParallel(mlx_model, group)
    except (ValueError, TypeError) as error:
        return user_error(parser.prog, f"rank {group.rank()}: {error}")
    config = engine_config(args, selection)
    if group.rank() != 0:
        # Ctrl-C and SIGTERM are for rank 0's server, which drains and then stops this rank's loop.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            selection.distributed_engine.follow_engine(model, config).follow()
        except selection.distributed_engine.RankLost as error:
            return user_error(parser.prog, str(error))
        return 0
    log = lambda line: print(f"[engine] {line}", file=sys.stderr, flush=True)  # noqa: E731
    engine = selection.distributed_engine.TensorParallelEngine(model, tokenizer, config, log=log)
    stop_when_a_rank_is_lost(engine, selection.distributed_engine.RankLost, parser.prog)
    try:
        warm_up(engine, selection)
        app = selection.server.create_app(engine, tokenizer, args.served_model_name or args.model,
                                          **server_options(args))
        print(f"[tiny-llm] serving on {group.size()} ranks, HTTP on rank 0: http://{args.host}:{args.port}",
              file=sys.stderr, flush=True)
        uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
        DrainingServer(uvicorn_config, args.shutdown_timeout).run()
        engine.shutdown()  # the other ranks' loops end: the launch ends
    except selection.distributed_engine.RankLost as error:
        return user_error(parser.prog, str(error))
    print("[tiny-llm] stopped", file=sys.stderr)
    return 0


def stop_when_a_rank_is_lost(engine, rank_lost, prog: str) -> None:
    """A step that loses a rank fails its requests (the server's engine thread does that) and stops the
    server: one line, then the same drain as Ctrl-C; nothing can run without every shard."""
    step = engine.step

    def step_or_stop():
        try:
            return step()
        except rank_lost as error:
            print(f"{prog}: error: {error}; stopping the server", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            raise

    engine.step = step_or_stop


def default_model_name(args) -> str:
    from course.models import default_model

    args.model = default_model() if args.model is None else args.model
    return args.model


def warm_up(engine, selection) -> None:
    """One token through the engine on this thread: whatever the model left lazy is evaluated before the
    engine thread takes over (MLX streams are thread-local)."""
    engine.add_request([0], selection.sequence.SamplingParams(max_tokens=1))
    while engine.has_work():
        engine.step()


def serve(parser, args) -> int:
    """Load the model, build the engine and the app, and serve until Ctrl-C or SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(name)s] %(message)s", stream=sys.stderr)
    blas = fast_mlx.setup()
    import mlx.core as mx

    from course.models import MEANINGLESS_NOTE, default_model, describe_model, is_embedded, load_model, resolve_model

    selection = selector.for_command(args.solution, args.strict)
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
        app = server.create_app(engine, tokenizer, name, **server_options(args))
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
    return selection.engine.LLMEngine(model, tokenizer, engine_config(args, selection), log=log)


ENGINE_KNOBS = ("token_budget", "budget_policy", "target_itl", "target_ttft", "max_num_seqs", "block_size",
                "num_blocks", "enable_prefix_caching", "scheduling_policy", "log_interval")


def engine_config(args, selection):
    """The knobs given on the command line as an `EngineConfig`; every other knob keeps its default."""
    given = {name: vars(args)[name] for name in ENGINE_KNOBS if vars(args)[name] is not None}
    return selection.engine.EngineConfig(**given)


if __name__ == "__main__":
    sys.exit(main())
