"""Monte Carlo simulation of a job with random failures: the check on ``goodput.model``.

Simulates, failure by failure, the process the model describes (see ``model``'s
docstring and ``docs/goodput.md``) without its approximations:

- while running, the job computes tau seconds, then a save blocks delta seconds; save n
  (counted over the whole job) is kept by tier i when n % k_i == 0 and is recoverable from
  it L_i seconds after it began; saves still in flight when a failure hits are lost;
- failures are Poisson (rate lambda, wall time, running or recovering); each draws a class
  j with probability f_j and destroys what tiers 0..j-1 hold;
- the job resumes from the newest surviving copy in any tier (as ``Checkpointer.load``
  does), after a restart R and that tier's reload T; a failure during recovery starts the
  recovery again; a finished recovery heals the faster tiers with the restored state;
- badput = 1 - (progress held at the horizon) / horizon.

No torch; numpy only for the random numbers. One loop iteration per failure: the
periodic save pattern between failures is computed in closed form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from incluster.goodput.model import ModelConfig, optimize, tier_every


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Simulated shares of wall time, means over independent runs."""

    interval_s: float
    """tau used."""
    tier_every: tuple[int, ...]
    """k_i used."""
    badput: float
    """1 - kept progress / wall time, mean over runs."""
    badput_stderr: float
    """Standard error of ``badput`` across runs."""
    save: float
    """Share of wall time blocked by saves."""
    lost: float
    """Share spent on compute that failures threw away."""
    restart: float
    """Share spent restarting."""
    reload: float
    """Share spent reloading."""
    failures: int
    """Failures simulated, in all runs, during recovery included."""
    runs: int
    """Independent runs."""


class _Draws:
    """Batched random numbers: exponential inter-failure times and failure classes."""

    def __init__(self, rng: np.random.Generator, rate: float, fractions: list[float]) -> None:
        self._rng, self._mean = rng, 1.0 / rate
        self._cum = np.cumsum(np.asarray(fractions, dtype=float))
        self._cum[-1] = 1.0
        self._exp: list[float] = []
        self._cls: list[int] = []

    def gap(self) -> float:
        if not self._exp:
            self._exp = self._rng.exponential(self._mean, 4096).tolist()
        return self._exp.pop()

    def failure_class(self) -> int:
        if not self._cls:
            u = self._rng.random(4096)
            self._cls = np.searchsorted(self._cum, u, side="right").tolist()
        return min(self._cls.pop(), len(self._cum) - 1)


def _run(config: ModelConfig, tau: float, ks: tuple[int, ...], horizon: float,
         rng: np.random.Generator) -> tuple[float, float, float, float, float, int]:
    """One run: (kept progress, blocked, lost, restart, reload, failures) in seconds."""
    tiers = config.tiers
    n = len(tiers)
    delta, restart_s = config.blocking_s, config.restart_s
    period = tau + delta
    draws = _Draws(rng, config.rate_per_s, [t.serves_fraction for t in tiers])
    latest = [0.0] * n  # progress of the newest copy each tier holds (-inf: destroyed)
    t = 0.0
    base = 0.0  # progress at the start of the running segment
    saves = 0  # saves begun so far over the whole job
    blocked = lost = restart = reload = 0.0
    failures = 0
    while True:
        x = draws.gap()
        end = t + x >= horizon
        if end:
            x = horizon - t
        full = math.floor(x / period)
        compute = full * tau + min(x - full * period, tau)
        blocked += x - compute
        live = base + compute
        if end:
            return live, blocked, lost, restart, reload, failures
        for i, tier in enumerate(tiers):  # newest save of tier i recoverable before x
            last = math.floor((x - tier.time_to_recoverable_s + delta) / period)
            if last >= 1:
                last -= (saves + last) % ks[i]
                if last >= 1:
                    latest[i] = base + last * tau
        saves += math.floor((x + delta) / period)
        t += x
        # A failure: destroy the faster tiers, recover from the newest survivor.
        target = live
        while True:
            failures += 1
            cls = draws.failure_class()
            for i in range(cls):
                latest[i] = -math.inf
            src = max(range(n), key=lambda i: (latest[i], -i))
            lost += target - latest[src]
            target = latest[src]
            need = restart_s + tiers[src].reload_s
            y = draws.gap()
            done = y >= need
            spent = min(y, need, horizon - t)
            restart += min(spent, restart_s)
            reload += spent - min(spent, restart_s)
            t += spent
            if t >= horizon:
                return target, blocked, lost, restart, reload, failures
            if done:
                break
        for i in range(src):  # heal: the restored state is written back to faster tiers
            latest[i] = target
        base = target


def simulate(
    config: ModelConfig,
    *,
    interval_s: float | None = None,
    expected_failures: int = 20000,
    runs: int = 8,
    seed: int = 0,
) -> SimResult:
    """Simulate ``runs`` independent jobs, ``expected_failures`` failures in all.

    The interval is ``interval_s``, else the config's, else the model's optimum, so the
    simulator checks the model at the same point; k_i come from ``model.tier_every``.
    """
    if expected_failures < runs or runs < 2:
        raise ValueError("need runs >= 2 and expected_failures >= runs")
    tau = interval_s if interval_s is not None else config.interval_s
    if tau is None:
        tau = optimize(config).interval_s
    if tau <= 0:
        raise ValueError("interval_s must be > 0")
    ks = tier_every(config, tau + config.blocking_s)
    horizon = expected_failures / runs / config.rate_per_s
    seqs = np.random.SeedSequence(seed).spawn(runs)
    rows = np.array(
        [_run(config, tau, ks, horizon, np.random.default_rng(s)) for s in seqs], dtype=float
    )
    bad = 1.0 - rows[:, 0] / horizon
    mean = rows.mean(axis=0) / horizon
    return SimResult(
        interval_s=tau,
        tier_every=ks,
        badput=float(bad.mean()),
        badput_stderr=float(bad.std(ddof=1) / math.sqrt(runs)),
        save=float(mean[1]),
        lost=float(mean[2]),
        restart=float(mean[3]),
        reload=float(mean[4]),
        failures=int(rows[:, 5].sum()),
        runs=runs,
    )


__all__ = ["SimResult", "simulate"]
