"""The statistics of ``ddpkit bench``: medians, quartiles, the median's confidence interval, the verdict."""

from __future__ import annotations

import statistics

__all__ = ["median_ci", "median_ms", "pair_ratios", "quartiles", "relative_spread", "verdict"]


def median_ms(xs: list[float]) -> float:
    """The median of ``xs`` seconds, in milliseconds."""
    return 1000.0 * statistics.median(xs)


def quartiles(xs: list[float], scale: float = 1.0) -> tuple[float, float]:
    """The 25 % and 75 % quartiles of ``xs`` (both the value itself for one sample), times ``scale``."""
    if len(xs) < 2:
        return (scale * xs[0], scale * xs[0]) if xs else (0.0, 0.0)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return scale * q1, scale * q3


def median_ci(xs: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``xs`` (95 % for ``z=1.96``).

    Order statistics: the count of samples below the true median is
    Binomial(n, 1/2), so the interval runs from the ``n/2 - z*sqrt(n)/2``-th
    to the ``n/2 + z*sqrt(n)/2``-th smallest sample (normal approximation,
    rounded outwards). It assumes nothing about the ratios' distribution, only
    that the pairs are independent. With 10 samples or fewer it is the
    whole range.
    """
    if not xs:
        return (0.0, 0.0)
    ordered = sorted(xs)
    n = len(ordered)
    half = z * n**0.5 / 2
    lo = max(0, int(n / 2 - half) - 1)
    hi = min(n - 1, -int(-(n / 2 + half)))  # ceil, as an index from 0 that counts 1 past the rank
    return ordered[lo], ordered[hi]


def verdict(ci: tuple[float, float]) -> str:
    """``faster`` or ``slower`` when the ratio's confidence interval lies on one side of 1, else ``level``."""
    if ci[1] < 1.0:
        return "faster"
    if ci[0] > 1.0:
        return "slower"
    return "level"


def relative_spread(xs: list[float]) -> float:
    """IQR / median: how tight a set of ratios is (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    q1, q3 = quartiles(xs)
    return (q3 - q1) / statistics.median(xs)


def pair_ratios(times: dict[str, list[float]], ours: str = "ddpkit", theirs: str = "torch") -> list[float]:
    """``ours`` / ``theirs`` (ddpkit / torch) for each pair of steps run back to back (one of each engine)."""
    return [a / b for a, b in zip(times[ours], times[theirs])]
