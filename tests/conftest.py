"""Shared test set-up: fast BLAS before MLX, float32 on the CPU, readable "not implemented" failures."""

from scripts import fast_mlx

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
        report.longrepr = f"{item.nodeid}\n    not implemented yet: {call.excinfo.value}"


@pytest.fixture(scope="session")
def embedded_model():
    """(mlx-lm model, tokenizer) of the embedded tiny Qwen2, float32 on the CPU; loaded once."""
    from scripts.models import load_model

    return load_model("embedded")
