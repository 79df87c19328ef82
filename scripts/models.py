"""Where the course's models live, and building them.

    pdm run models                 # where each model lives, and whether it is there
    pdm run models --make-bench    # build the 0.5B-shape benchmark model in the cache
    pdm run models --make-embedded # rebuild the committed embedded model (maintainers)
"""

import argparse

from course.models import (BENCH, BENCH_MODEL_DIR, EMBEDDED, EMBEDDED_MODEL_DIR, TINY_CONFIG, make_random_qwen2,
                           resolve_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdm run models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-embedded", action="store_true", help="rebuild the committed embedded model")
    parser.add_argument("--make-bench", action="store_true", help="build the 0.5B-shape model in the cache")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.make_embedded:
        make_random_qwen2(EMBEDDED_MODEL_DIR, TINY_CONFIG, seed=0)
    if args.make_bench:
        resolve_model(BENCH)
    for label, path, note in [
        (EMBEDDED, EMBEDDED_MODEL_DIR, "tiny Qwen2, random weights, committed"),
        (BENCH, BENCH_MODEL_DIR, "Qwen2-0.5B shape, random weights, built on first use"),
    ]:
        state = "present" if (path / "model.safetensors").exists() else "not built yet"
        print(f"{label:12s} {path}  ({note}; {state})")


if __name__ == "__main__":
    main()
