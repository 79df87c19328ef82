"""The README keeps its promises: the set-up commands exist and the roadmap matches the course."""

import tomllib

from maint.roadmap import README, REPO_ROOT, readme_with_table


def test_roadmap_table_is_up_to_date():
    text = README.read_text()
    assert text == readme_with_table(text), (
        "README.md's roadmap is stale: run `pdm run python -m maint.roadmap --write`")


def test_setup_commands_are_defined_scripts():
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pdm"]["scripts"]
    text = README.read_text()
    for command in ("pdm install && pdm run models fetch smollm2-135m && pdm run main", "pdm run test-ref"):
        assert command in text, f"README.md no longer shows the set-up command `{command}`"
    for name in ("main", "test-ref", "test", "batch-main", "compare", "grade", "bench-chunked-prefill"):
        assert name in scripts, f"README.md names `pdm run {name}`, which pyproject.toml does not define"
