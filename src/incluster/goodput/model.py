"""The analytic badput model: what checkpointing costs a job, and the interval to use.

Pure Python (no torch, no numpy): used by ``incluster goodput plan``, by the goodput figure
(``goodput.plot``) and checked against the Monte Carlo simulator (``goodput.simulate``).
The equations, their assumptions and a worked example are in ``docs/goodput.md``.

The job alternates compute (``interval_s`` = tau seconds) and a save that blocks
``blocking_s`` = delta seconds, so saves come every P = tau + delta seconds of running
time. Every save goes to tier 0; tier i keeps every k_i-th save. A save taken at time s
is recoverable from tier i at s + L_i (``time_to_recoverable_s``, >= delta). Failures
arrive as a Poisson process, lambda per second of wall time, during running and recovery
alike. A fraction f_i of failures (``serves_fraction``) destroys tiers 0..i-1 and is
served by tier i; recovering takes restart R plus reload T_i, and a failure during
recovery starts it again. With these assumptions, to first order in lambda*P for the work
lost and exactly for the recovery time:

    rho       = sum_i f_i exp(-lambda (R + T_i))       share of wall time spent running
    save      = (delta / P) (1 - lambda tau / 2)        blocked share of running time
    lost      = lambda sum_i f_i (tau / P)(L_i + k_i P / 2 - delta / 2)
    badput    = 1 - rho (1 - save - lost)

For one tier with L = delta (a synchronous save) this is the classic exact model below to
first order; minimising it gives Young's interval, P* ~ sqrt(2 delta / lambda).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

SECONDS_PER_DAY = 86400.0


def young_interval(blocking_s: float, rate_per_s: float) -> float:
    """Young (1974): the compute time between saves minimising badput, sqrt(2 delta/lambda)."""
    _check_rate(blocking_s, rate_per_s)
    return math.sqrt(2.0 * blocking_s / rate_per_s)


def daly_interval(blocking_s: float, rate_per_s: float) -> float:
    """Daly (2006), the higher-order estimate, with M = 1/lambda.

    sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta for delta < 2M,
    else M.
    """
    _check_rate(blocking_s, rate_per_s)
    m = 1.0 / rate_per_s
    if blocking_s >= 2.0 * m:
        return m
    x = blocking_s / (2.0 * m)
    return math.sqrt(2.0 * blocking_s * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - blocking_s


def exact_completion_time(
    work_s: float, interval_s: float, blocking_s: float, recovery_s: float, rate_per_s: float
) -> float:
    """Expected wall time to finish ``work_s`` of compute with synchronous saves.

    Segments of tau compute + delta save must each run without a failure; a failure loses
    the segment and costs a recovery of ``recovery_s`` (= R + T), itself restarted by a
    failure. For exponential failures:
    E = (W / tau) e^(lambda R) (e^(lambda (tau + delta)) - 1) / lambda.
    """
    if work_s < 0 or interval_s <= 0 or recovery_s < 0:
        raise ValueError("work_s and recovery_s must be >= 0 and interval_s > 0")
    _check_rate(blocking_s, rate_per_s)
    lam = rate_per_s
    return (work_s / interval_s) * math.exp(lam * recovery_s) * math.expm1(
        lam * (interval_s + blocking_s)
    ) / lam


def exact_badput(
    interval_s: float, blocking_s: float, recovery_s: float, rate_per_s: float
) -> float:
    """1 - W / E[T] of ``exact_completion_time`` (independent of W)."""
    return 1.0 - 1.0 / exact_completion_time(1.0, interval_s, blocking_s, recovery_s, rate_per_s)


def exact_optimal_interval(blocking_s: float, rate_per_s: float) -> float:
    """The tau minimising ``exact_badput``; independent of the recovery time.

    Setting the derivative to zero gives e^(lambda P) (1 - lambda tau) = 1 with
    P = tau + delta, solved here by bisection.
    """
    _check_rate(blocking_s, rate_per_s)
    lam = rate_per_s

    def g(tau: float) -> float:
        return math.exp(lam * (tau + blocking_s)) * (1.0 - lam * tau) - 1.0

    lo, hi = 0.0, 1.0 / lam  # g(0) >= 0, g(1/lambda) = -1
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if g(mid) > 0 else (lo, mid)
    return 0.5 * (lo + hi)


def _check_rate(blocking_s: float, rate_per_s: float) -> None:
    if blocking_s < 0:
        raise ValueError(f"blocking_s must be >= 0, got {blocking_s}")
    if not rate_per_s > 0:
        raise ValueError(f"the failure rate must be > 0, got {rate_per_s}")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One storage tier as the model sees it."""

    name: str
    """A label, e.g. "local", "replica", "persistent"."""
    serves_fraction: float
    """f_i: share of failures this tier serves (tiers before it are lost in them)."""
    time_to_recoverable_s: float
    """L_i: seconds from save() until the save can be restored from this tier."""
    reload_s: float
    """T_i: seconds to restore the state from this tier."""
    every: int | None = None
    """k_i: the tier keeps every k-th save; None = the smallest that keeps up (see below)."""
    min_interval_s: float = 0.0
    """A floor on the tier's interval k_i P (e.g. to bound background upload traffic)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.serves_fraction <= 1.0:
            raise ValueError(f"tier {self.name}: serves_fraction must be within [0, 1]")
        if self.time_to_recoverable_s < 0 or self.reload_s < 0 or self.min_interval_s < 0:
            raise ValueError(
                f"tier {self.name}: time_to_recoverable_s, reload_s and min_interval_s "
                "must be >= 0"
            )
        if self.every is not None and self.every < 1:
            raise ValueError(f"tier {self.name}: every must be >= 1 or None")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A job and its checkpointing configuration."""

    interruptions_per_day: float
    """Failures per day of the whole job (lambda = this / 86400 s)."""
    blocking_s: float
    """delta: seconds each save blocks training, background slowdown included."""
    tiers: tuple[TierConfig, ...]
    """Fastest first; every save goes to tier 0; fractions sum to 1."""
    restart_s: float = 0.0
    """R: seconds from a failure until training processes are ready, reload excluded."""
    gpus: int = 1
    """Job size, to express badput in GPU-hours."""
    interval_s: float | None = None
    """tau: compute seconds between saves; None = the interval minimising badput."""
    min_interval_s: float = 1.0
    """The shortest tau to consider: about one training step."""

    def __post_init__(self) -> None:
        if not self.interruptions_per_day > 0:
            raise ValueError("interruptions_per_day must be > 0")
        if self.blocking_s < 0 or self.restart_s < 0:
            raise ValueError("blocking_s and restart_s must be >= 0")
        if self.gpus < 1:
            raise ValueError("gpus must be >= 1")
        if not self.tiers:
            raise ValueError("give at least one tier")
        if abs(sum(t.serves_fraction for t in self.tiers) - 1.0) > 1e-6:
            raise ValueError("the tiers' serves_fraction must sum to 1")
        if self.tiers[0].every not in (None, 1):
            raise ValueError("tier 0 receives every save: its every must be 1 or None")
        for t in self.tiers:
            if t.time_to_recoverable_s < self.blocking_s:
                raise ValueError(
                    f"tier {t.name}: time_to_recoverable_s must be >= blocking_s; a save "
                    "cannot be recoverable before save() returns"
                )
        if self.interval_s is not None and self.interval_s <= 0:
            raise ValueError("interval_s must be > 0 or None")
        if not self.min_interval_s > 0:
            raise ValueError("min_interval_s must be > 0")

    @property
    def rate_per_s(self) -> float:
        """lambda, failures per second."""
        return self.interruptions_per_day / SECONDS_PER_DAY


@dataclass(frozen=True, kw_only=True)
class ModelResult:
    """Expected badput of a configuration at one interval; fractions of wall time."""

    interval_s: float
    """tau: compute seconds between saves."""
    tier_every: tuple[int, ...]
    """k_i per tier."""
    tier_interval_s: tuple[float, ...]
    """k_i P: running seconds between saves that reach each tier."""
    save: float
    """Share of wall time blocked by saves."""
    lost: float
    """Share spent on work lost to failures."""
    restart: float
    """Share spent restarting."""
    reload: float
    """Share spent reloading."""
    lost_per_failure_s: tuple[float, ...] = field(default=())
    """Expected compute seconds lost by a failure each tier serves."""
    gpus: int = 1
    """Job size, for ``gpu_hours_per_day``."""

    @property
    def badput(self) -> float:
        """Total badput share."""
        return self.save + self.lost + self.restart + self.reload

    @property
    def checkpoint_badput(self) -> float:
        """Badput that depends on checkpointing: all but restart."""
        return self.save + self.lost + self.reload

    @property
    def gpu_hours_per_day(self) -> float:
        """GPU-hours lost per day of the job."""
        return self.badput * self.gpus * 24.0


def tier_every(config: ModelConfig, period_s: float) -> tuple[int, ...]:
    """k_i at save period P: as given, else the smallest with k_i P >= max(L_i, floor_i).

    An interval shorter than the time to recoverable would queue saves behind each other
    (one save in flight per tier), so a tier skips saves until it keeps up.
    """
    out = []
    for i, t in enumerate(config.tiers):
        if i == 0:
            out.append(1)
        elif t.every is not None:
            out.append(t.every)
        else:
            need = max(t.time_to_recoverable_s, t.min_interval_s)
            out.append(max(1, math.ceil(need / period_s - 1e-9)))
    return tuple(out)


def evaluate(config: ModelConfig, interval_s: float | None = None) -> ModelResult:
    """Expected badput at ``interval_s`` (default: the config's; None there = optimal)."""
    tau = interval_s if interval_s is not None else config.interval_s
    if tau is None:
        return optimize(config)
    if tau <= 0:
        raise ValueError("interval_s must be > 0")
    lam, delta = config.rate_per_s, config.blocking_s
    p = tau + delta
    ks = tier_every(config, p)
    r = config.restart_s
    rho = sum(t.serves_fraction * math.exp(-lam * (r + t.reload_s)) for t in config.tiers)
    lost_c = tuple(
        (tau / p) * (t.time_to_recoverable_s + k * p / 2.0 - delta / 2.0)
        for t, k in zip(config.tiers, ks)
    )
    save = (delta / p) * max(0.0, 1.0 - lam * tau / 2.0)  # first order: never below zero past its range
    lost = lam * sum(t.serves_fraction * c for t, c in zip(config.tiers, lost_c))
    down = 1.0 - rho
    # Each recovery attempt runs min(X, R + T_i) with X ~ Exp(lambda): the restart phase
    # takes E[min(X, R)] of it, whatever the tier.
    in_restart = -math.expm1(-lam * config.restart_s)
    in_recovery = sum(
        t.serves_fraction * -math.expm1(-lam * (r + t.reload_s)) for t in config.tiers
    )
    restart_share = in_restart / in_recovery if in_recovery > 0 else 0.0
    return ModelResult(
        interval_s=tau,
        tier_every=ks,
        tier_interval_s=tuple(k * p for k in ks),
        save=rho * save,
        lost=rho * lost,
        restart=down * restart_share,
        reload=down * (1.0 - restart_share),
        lost_per_failure_s=lost_c,
        gpus=config.gpus,
    )


def optimize(config: ModelConfig) -> ModelResult:
    """The interval tau minimising total badput.

    A log grid, then golden-section search around its best point, then the points where a
    tier's k_i changes (badput jumps there, so a search between grid points can miss them).

    tau starts at max(min_interval_s, max(L_0, tier 0's floor) - delta): tier 0 takes every
    save, so saves may not come faster than tier 0 makes them recoverable.
    """
    lam = config.rate_per_s
    t0 = config.tiers[0]
    floor0 = max(t0.time_to_recoverable_s, t0.min_interval_s)
    lo = max(config.min_interval_s, floor0 - config.blocking_s)
    hi = max(lo * 2.0, 5.0 / lam)

    def cost(tau: float) -> float:
        return evaluate(config, tau).badput

    n = 240
    grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    costs = [cost(t) for t in grid]
    best = min(range(n), key=costs.__getitem__)
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, n - 1)]
    phi = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = cost(c), cost(d)
    for _ in range(80):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = cost(d)
    candidates = [(costs[best], grid[best]), (fc, c), (fd, d)]
    # k_i jumps where k_i P = need_i: the left edge of each piece is a candidate too.
    for t in config.tiers[1:]:
        need = max(t.time_to_recoverable_s, t.min_interval_s)
        if t.every is not None or need <= 0:
            continue
        k_max = min(2000, math.ceil(need / (lo + config.blocking_s)))
        for k in range(1, k_max + 1):
            tau = need / k - config.blocking_s
            if lo <= tau <= hi:
                candidates.append((cost(tau), tau))
    return evaluate(config, min(candidates)[1])


def with_rate(config: ModelConfig, interruptions_per_day: float) -> ModelConfig:
    """The same configuration at another failure rate."""
    return replace(config, interruptions_per_day=interruptions_per_day)


__all__ = [
    "SECONDS_PER_DAY",
    "ModelConfig",
    "ModelResult",
    "TierConfig",
    "daly_interval",
    "evaluate",
    "exact_badput",
    "exact_completion_time",
    "exact_optimal_interval",
    "optimize",
    "tier_every",
    "with_rate",
    "young_interval",
]
