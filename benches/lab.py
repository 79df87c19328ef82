"""What every lab shares around the runner: its command line, its model, its machine line, its outputs.

    parser = lab.parser("pdm run bench-x", __doc__, out="x.json")   # --model, --quick, --solution, --strict, --out
    ...bench-specific options...
    bench = lab.start(parser.parse_args(argv), ("engine",))   # whose code runs (said in one line), the model
    bench.selection.engine, bench.week3_model(), bench.mlx_model, bench.machine
    lab.print_table(title, COLUMNS, rows)          # one rich table
    with lab.figure(bench.figure_path("itl"), bench.machine) as (fig, ax): ...
    return bench.save(results, plots)              # the JSON where --out says (plots beside it)

Whose code runs comes from the selector (`--solution student`, `--strict`): the student's code for
every task written, the reference's for the others, announced in one line. The lab's own
measuring (metrics, percentiles) is always the reference's; the peer is mlx-lm on the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from course import fast_mlx, selector
from course.models import BENCH, BENCH_MODEL_DIR, EMBEDDED, MEANINGLESS_NOTE, is_embedded, load_model, resolve_model
from course.user_errors import OneLineParser, user_error

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BENCH_NOTE = ("note: the Qwen2-0.5B-shape benchmark model has random weights at Qwen2-0.5B's real dimensions: "
              "its timings are real, its text is meaningless.")


def parser(prog: str, doc: str, out: str, model: bool = True) -> OneLineParser:
    """The options every lab shares: --model (when it loads one), --quick, --solution/--strict, --out."""
    made = OneLineParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model:
        made.add_argument("--model", default=BENCH,
                          help=f"'{BENCH}' (default), '{EMBEDDED}', a local checkpoint or a Hugging Face id")
    made.add_argument("--quick", action="store_true", help="a smaller run of the same experiment")
    selector.add_arguments(made)
    made.add_argument("--out", type=Path, default=RESULTS_DIR / out,
                      help=f"the JSON file to write (default benches/results/{out}); plots go beside it")
    return made


def options(parser, **defaults) -> None:
    """Add `--name` options from keyword defaults: `rate=0.5` or, with help, `rate=(0.5, "arrivals per second")`."""
    for name, spec in defaults.items():
        default, help_text = spec if isinstance(spec, tuple) else (spec, "")
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=f"{help_text} (default {default})".strip())


def check_positive(prog: str, args, *names: str) -> None:
    """Exit with one line if any of these integer options is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(user_error(prog, f"--{name.replace('_', '-')} must be >= 1"))


def machine_line() -> str:
    """Platform, MLX and its device, cores, BLAS, and how busy the machine was: printed and saved with every result."""
    blas = fast_mlx.blas_in_use().split(" (")[0]  # the library's name, not its path
    return (f"{platform.system()} {platform.machine()}, MLX {mx.__version__} on {mx.default_device()}, "
            f"{os.cpu_count()} cores, BLAS: {blas}, load average {os.getloadavg()[0]:.1f} at start")


def model_note(path: Path) -> str | None:
    """What to say about a model with random weights (None for a trained one)."""
    if not is_embedded(path):
        return None
    return BENCH_NOTE if Path(path).resolve() == BENCH_MODEL_DIR.resolve() else MEANINGLESS_NOTE


@dataclass
class Bench:
    """A started lab: its arguments, whose code runs, the model (mlx-lm's), its tokenizer, the machine line."""

    args: object
    selection: selector.Selection
    mlx_model: object
    tokenizer: object
    machine: str

    def week2_model(self):
        """The selection's week-2 model on the same weights."""
        return self.selection.qwen2_week2.Qwen2ModelWeek2(self.mlx_model)

    def week3_model(self):
        """The selection's week-3 model on the same weights."""
        return self.selection.qwen2_week3.Qwen2ModelWeek3(self.mlx_model)

    def figure_path(self, name: str) -> Path:
        """Where a plot goes: beside the JSON, `<json stem>_<name>.png`."""
        return self.args.out.with_name(f"{self.args.out.stem}_{name}.png")

    def save(self, results: dict, plots=()) -> int:
        """Write the results (with the machine line, model and solution) to --out, say what was written; exit status 0."""
        path = save_json(self.args.out, {"machine": self.machine, "model": getattr(self.args, "model", None),
                                         "solution": self.args.solution, "strict": self.args.strict,
                                         "args": arguments(self.args), **results})
        print(f"wrote {', '.join(map(str, [path, *plots]))}")
        return 0


def start(args, modules: tuple[str, ...], load: bool = True) -> Bench:
    """Pick whose code runs, load its `modules` and say which tasks came from the reference; load the model."""
    selection = selector.for_command(args.solution, args.strict)
    for module in modules:
        getattr(selection, module)  # imported now, so the line below names every task they take
    selector.announce(selection)
    mlx_model = tokenizer = None
    if load:
        path = resolve_model(args.model)
        note = model_note(path)
        if note:
            print(note)
        mlx_model, tokenizer = load_model(args.model)
    machine = machine_line()
    print(f"{'model ' + args.model + '; ' if load else ''}code: {describe(selection)}; {machine}")
    return Bench(args, selection, mlx_model, tokenizer, machine)


def describe(selection: selector.Selection) -> str:
    """'the reference', 'your src/tiny_llm' or 'your src/tiny_llm (--strict)'."""
    if selection.package == selector.REFERENCE_PACKAGE:
        return "the reference (src_ref/tiny_llm_ref)"
    return "your src/tiny_llm" + (" (--strict)" if selection.package == selector.STUDENT_PACKAGE else "")


def save_json(path: Path, data: dict) -> Path:
    """Write `data` as JSON to `path` (a file; its directory is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def arguments(args) -> dict:
    """The parsed options, JSON-ready."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    fmt: str = "{:.2f}"  # applied to the value; None prints "-"

    def cell(self, row: dict) -> str:
        value = row.get(self.key)
        return "-" if value is None else self.fmt.format(value)


def print_table(title: str, columns: list[Column], rows: list[dict], caption: str | None = None) -> None:
    """One table: a row per configuration, a column per figure (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column.header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(column.cell(row) for column in columns))
    Console(width=max(160, Console().width)).print(table)  # a log file or a pipe gets the whole table


# ---------------------------------------------------------------- plots


@contextlib.contextmanager
def figure(path: Path, machine: str, **subplots):
    """A matplotlib figure (off-screen) saved to `path` with the machine line in its corner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    yield fig, axes
    fig.text(0.99, 0.01, machine, ha="right", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_plot(bench: Bench, runs: dict, kind: str | None, title: str) -> Path:
    """Each run's TTFT per request of one class against its arrival time (log scale): `<json stem>_ttft.png`."""
    from benches.runner import ids_of

    path = bench.figure_path("ttft")
    with figure(path, bench.machine, figsize=(7, 3.5)) as (fig, ax):
        for label, run in runs.items():
            timelines = run.metrics.requests
            points = sorted((timelines[i].arrival - run.start, timelines[i].ttft) for i in ids_of(run, kind))
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        ax.set(xlabel=f"{kind or 'request'} arrival (s)", ylabel="TTFT (s)", yscale="log", title=title)
        ax.legend()
    return path


def legend_below(ax, *twins) -> None:
    """One legend for `ax` and its twin axes, under the plot: a legend inside the axes covers points."""
    handles, labels = [], []
    for axes in (ax, *twins):
        more_handles, more_labels = axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    below = -0.3 if ax.get_xlabel() else -0.12  # clear of the tick labels and of the axis label, if any
    ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, below),
              ncols=min(len(labels), 3), frameon=False)


def plot_series(ax, series: dict, styles=("o", ".", "x", "+", "s", "^")) -> None:
    """Draw each label's (x, y) points with its own marker, and a legend."""
    for (label, points), style in zip(series.items(), styles * (1 + len(series) // len(styles))):
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label, alpha=0.8)
    ax.legend(fontsize=8)


def progress(plans: list, desc: str):
    """Yield each plan (a configuration, or a tuple starting with its label) with a progress bar, naming it."""
    from tqdm import tqdm

    for plan in tqdm(plans, desc=desc, unit="run"):
        tqdm.write(f"  {plan[0] if isinstance(plan, tuple) else plan} ...")
        yield plan
