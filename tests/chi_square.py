"""A chi-square goodness-of-fit test without scipy: do observed counts follow a distribution?

Used by the statistical tests of day 4.1 (rejection sampling must keep the target's distribution):
each fails a correct solution with probability at most FALSE_ALARM.
"""

import math

FALSE_ALARM = 1e-3  # each statistical test fails a correct solution with at most this probability


def chi_square_p_value(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, statistic/2)."""
    a, x = dof / 2, statistic / 2
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    for n in range(1, 10_000):  # the series of the lower incomplete gamma; converges for every x
        term *= x / (a + n)
        total += term
        if term < total * 1e-15:
            break
    lower = math.exp(a * math.log(x) - x - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def assert_distribution(counts: dict, probs: dict, what: str):
    """Chi-square goodness of fit of observed `counts` to `probs` (cells with tiny expectations pooled)."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"{what}: outcomes the target can never give: {set(counts) - set(probs)}"
    cells, pooled_expected, pooled_observed = [], 0.0, 0
    for cell, p in probs.items():
        if n * p >= 5:
            cells.append((counts.get(cell, 0), n * p))
        else:
            pooled_expected += n * p
            pooled_observed += counts.get(cell, 0)
    if pooled_expected > 0:
        cells.append((pooled_observed, pooled_expected))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    p_value = chi_square_p_value(statistic, len(cells) - 1)
    assert p_value > FALSE_ALARM, (f"{what}: the samples do not follow the target's distribution "
                                   f"(chi-square {statistic:.1f} on {len(cells) - 1} dof, p = {p_value:.2g})")
