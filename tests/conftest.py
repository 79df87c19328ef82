"""Shared test set-up: fast BLAS before MLX, float32 on the CPU, no TF32 on CUDA, readable "not implemented"
failures, and how the tests share out over pytest-xdist's workers (`pdm run test-ref`)."""

import contextlib
import fcntl
import os
from pathlib import Path

from course import fast_mlx
from course.sandbox import SANDBOX_ROOT_VARIABLE  # imports no MLX: the BLAS below is still loaded first

# MLX's CUDA backend multiplies float32 matrices in TF32 by default (a 10-bit mantissa), which the tests'
# float32 tolerances against MLX's own operations and mlx-lm read as wrong answers. On an H100, every week-1
# and week-2 test that failed that way passed with TF32 off. Metal and the CPU never use TF32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# While grading, this process and the sandboxed worker take turns on the same cores (course/fast_mlx.py).
fast_mlx.setup(quiet=True, shared_cores=bool(os.environ.get(SANDBOX_ROOT_VARIABLE)))

import pytest  # noqa: E402

from tests.harness import solution_name  # noqa: E402


def pytest_report_header(config):
    return [f"tiny-llm: testing the {solution_name()} solution; BLAS: {fast_mlx.blas_in_use()}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(NotImplementedError):
        # The skeleton's message names the day, the task and the chapter: show it, not a traceback.
        # Its first line is also what the short summary shows after the test's name.
        report.longrepr = f"not implemented yet: {call.excinfo.value}"


@pytest.fixture(scope="session")
def embedded_model():
    """(mlx-lm model, tokenizer) of the embedded tiny Qwen2, float32 on the CPU; loaded once."""
    from course.models import load_model

    return load_model("embedded")


@pytest.fixture(scope="session")
def model32(embedded_model):
    """(mlx-lm model, tokenizer) of the embedded model in float32 on every device.

    `embedded_model` is float32 on the CPU but keeps the checkpoint's bfloat16 on a Mac's GPU, where
    bfloat16 rounding alone would exceed the logit tolerances of the model-level tests (and could flip
    a greedy token): those tests compare in float32 everywhere.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import qwen2 as mlx_qwen2

    model, tokenizer = embedded_model
    if all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters())):
        return model, tokenizer
    copy = mlx_qwen2.Model(model.args)
    copy.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(copy.parameters())
    return copy, tokenizer


# ---------------------------------------------------------------- the whole suite on several workers (pytest-xdist)
# A file's tests run on one worker, in order: its module-scoped fixtures (a two-rank launch, a server, a model) start
# once. The files below hold tests that each grade or check on their own, in subprocesses: they spread over workers.
SPREAD_FILES = {"test_tooling.py"}
# The workers take work in the collection's order, which puts these first: the files that take longest (two-rank
# launches, servers, real models; slowest first, by a whole run's durations), then the other files, then the spread
# tests, many and short, on which the workers finish together. A file missing here only starts later.
LONGEST_FILES = ("test_serve_tensor_parallel.py", "test_bad_input.py", "test_real_model_quantized_kv.py",
                 "test_real_model.py", "test_week_4_day_3.py", "test_book.py", "test_week_4_day_4.py",
                 "test_compare_week4.py", "test_compare_week3.py", "test_benches.py")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where xdist is absent or off (`-p no:xdist`)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (what `pdm run test-ref` asks for): a unit of work is a file, or one test of SPREAD_FILES,
    handed out in the collection's order. Our own, because pytest-xdist 3.8's groups (`xdist_group`) do nothing
    under pytest 9: xdist names a test's group in `item._nodeid`, which pytest 9's `nodeid` no longer reads, so every
    test was a unit of its own and a file's module fixtures started on both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # not by number of tests: a file of a few long ones would come last
    return FileScheduling(config, log)


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or itself in a spread file."""
    file = nodeid.split("::", 1)[0]
    return nodeid if Path(file).name in SPREAD_FILES else file


def work_order(item) -> int:
    """Where a test's file comes in the order the workers take work: LONGEST_FILES first, spread files last."""
    name = item.path.name
    if name in LONGEST_FILES:
        return LONGEST_FILES.index(name)
    return len(LONGEST_FILES) + (name in SPREAD_FILES)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a worker's collection is the order the work is handed out in
        items.sort(key=work_order)  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Outside pytest-timeout's wrapper: the wait for a turn does not count toward a test's time limit.
    with machine_turn(item):
        yield


@contextlib.contextmanager
def machine_turn(item):
    """Under xdist, a test marked `alone` runs while no other worker runs a test (it loads the machine on purpose,
    which would push a neighbour past its time limit); other tests run side by side. A readers-writer lock on a
    file the run's workers share: byte 0 is the gate an `alone` test holds throughout (so a stream of other tests
    cannot keep it waiting), byte 1 is held shared by every running test and exclusively by an `alone` one."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    # Every worker's basetemp is a folder of the run's own basetemp: the lock file lives beside them.
    lock_path = Path(item.config.option.basetemp).parent / "machine-turns.lock"
    with open(lock_path, "a+b") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX, 1, 0)
        fcntl.lockf(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, 1, 1)
        if not alone:
            fcntl.lockf(lock, fcntl.LOCK_UN, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN, 2, 0)  # closing the file would release them too
