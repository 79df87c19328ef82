"""What the sandboxed worker does before it serves the judge (course/sandbox.py), checked in a fresh interpreter."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_worker_defers_mlx_lms_start_up_until_mlx_lm_itself_is_read():
    """A model the judge hands over is built from `mlx_lm.models` alone: mlx-lm's package start-up (transformers
    and the rest, seconds of imports in every worker) waits for the first read of `mlx_lm` itself, and then
    everything the package offers is there."""
    probe = textwrap.dedent("""
        import sys
        from course import sandbox

        sandbox._defer_mlx_lm_start_up()
        import mlx_lm.models.cache, mlx_lm.models.qwen2
        print("transformers" in sys.modules)
        import mlx_lm
        try:
            mlx_lm.no_such_name
        except AttributeError:
            print("AttributeError")
        from mlx_lm import generate, load
        print(callable(load) and callable(generate), "transformers" in sys.modules, hasattr(mlx_lm, "__getattr__"))
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": ".", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "AttributeError", "True", "True", "False"], done.stdout
