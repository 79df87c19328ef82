"""Shared test set-up: fast BLAS before MLX, float32 on the CPU, readable "not implemented" failures."""

from course import fast_mlx

fast_mlx.setup(quiet=True)

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
