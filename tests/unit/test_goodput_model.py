"""goodput.model: closed forms and the badput model against hand-computed values."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from incluster.goodput import model as m
from incluster.goodput.model import ModelConfig, TierConfig, evaluate, optimize, tier_every

PER_DAY = 86400.0


def one_tier(delta: float, *, rate: float, reload_s: float = 0.0, restart_s: float = 0.0,
             recoverable: float | None = None, interval_s: float | None = None) -> ModelConfig:
    tier = TierConfig(name="persistent", serves_fraction=1.0,
                      time_to_recoverable_s=delta if recoverable is None else recoverable,
                      reload_s=reload_s)
    return ModelConfig(interruptions_per_day=rate * PER_DAY, blocking_s=delta, tiers=(tier,),
                       restart_s=restart_s, interval_s=interval_s)


def test_young_and_daly_by_hand() -> None:
    assert m.young_interval(50, 1 / 3600) == pytest.approx(600)  # sqrt(2 * 50 * 3600)
    # M = 3600, x = delta/2M = 1/144, sqrt(x) = 1/12: 600 (1 + 1/36 + 1/1296) - 50
    assert m.daly_interval(50, 1 / 3600) == pytest.approx(600 + 600 / 36 + 600 / 1296 - 50)
    assert m.daly_interval(8000, 1 / 3600) == 3600  # delta >= 2M: M
    with pytest.raises(ValueError, match="rate"):
        m.young_interval(1, 0)


def test_exact_completion_time_by_hand() -> None:
    lam = math.log(2) / 650  # e^(lambda (tau + delta)) = 2 and e^(lambda R) = 2
    e = m.exact_completion_time(600, 600, 50, 650, lam)
    assert e == pytest.approx(1 * 2 * (2 - 1) / lam) == pytest.approx(1300 / math.log(2))
    assert m.exact_badput(600, 50, 650, lam) == pytest.approx(1 - 600 * math.log(2) / 1300)


def test_exact_optimum_solves_its_equation_and_is_near_daly() -> None:
    lam, delta = 1 / 3600, 50
    tau = m.exact_optimal_interval(delta, lam)
    assert math.exp(lam * (tau + delta)) * (1 - lam * tau) == pytest.approx(1, abs=1e-12)
    best = m.exact_badput(tau, delta, 0, lam)
    assert best < m.exact_badput(tau * 0.98, delta, 0, lam)
    assert best < m.exact_badput(tau * 1.02, delta, 0, lam)
    # Daly's higher-order estimate is within 1 % here; Young's (no "- delta") is not.
    assert tau == pytest.approx(m.daly_interval(delta, lam), rel=0.01)
    assert abs(m.young_interval(delta, lam) - tau) / tau > 0.05
    # the optimum does not depend on the recovery time (e^(lambda R) is a factor)
    r_best = m.exact_badput(tau, delta, 500, lam)
    assert r_best < m.exact_badput(tau * 1.02, delta, 500, lam)


def test_one_tier_breakdown_by_hand() -> None:
    # delta 10, tau 290 -> P 300; L = delta (synchronous); T 20, R 40; lambda 1/3000
    cfg = one_tier(10, rate=1 / 3000, reload_s=20, restart_s=40, interval_s=290)
    r = evaluate(cfg)
    rho = math.exp(-60 / 3000)
    save = (10 / 300) * (1 - 290 / 3000 / 2)  # 0.0317222
    lost = (290 / 300) * (10 + 150 - 5) / 3000  # 0.0499444
    assert r.save == pytest.approx(rho * save)
    assert r.lost == pytest.approx(rho * lost)
    assert r.badput == pytest.approx(1 - rho * (1 - save - lost))
    assert r.badput == pytest.approx(0.09985, abs=1e-5)
    restart_share = (1 - math.exp(-40 / 3000)) / (1 - math.exp(-60 / 3000))
    assert r.restart == pytest.approx((1 - rho) * restart_share)
    assert r.reload == pytest.approx((1 - rho) * (1 - restart_share))
    assert r.lost_per_failure_s == pytest.approx(((290 / 300) * 155,))
    # the classic exact model for the same job differs by the second-order term (lambda P)^2/12
    exact = m.exact_badput(290, 10, 60, 1 / 3000)
    assert exact == pytest.approx(0.099062, abs=1e-6)
    assert abs(r.badput - exact) < 1.5 * (300 / 3000) ** 2 / 12


def test_three_tiers_by_hand() -> None:
    tiers = (
        TierConfig(name="local", serves_fraction=0.5, time_to_recoverable_s=2, reload_s=5),
        TierConfig(name="replica", serves_fraction=0.4, time_to_recoverable_s=30, reload_s=20),
        TierConfig(name="persistent", serves_fraction=0.1, time_to_recoverable_s=250, reload_s=100),
    )
    cfg = ModelConfig(interruptions_per_day=PER_DAY / 5000, blocking_s=1, tiers=tiers,
                      restart_s=50, interval_s=99, gpus=1000)
    r = evaluate(cfg)
    assert r.tier_every == (1, 1, 3)  # persistent: ceil(250 / 100)
    assert r.tier_interval_s == pytest.approx((100, 100, 300))
    lost_c = (0.99 * 51.5, 0.99 * 79.5, 0.99 * 399.5)  # (tau/P)(L + kP/2 - delta/2)
    assert r.lost_per_failure_s == pytest.approx(lost_c)
    rho = 0.5 * math.exp(-55 / 5000) + 0.4 * math.exp(-70 / 5000) + 0.1 * math.exp(-150 / 5000)
    save = 0.01 * (1 - 99 / 10000)
    lost = (0.5 * lost_c[0] + 0.4 * lost_c[1] + 0.1 * lost_c[2]) / 5000  # 0.019305
    assert lost == pytest.approx(0.019305)
    assert r.badput == pytest.approx(1 - rho * (1 - save - lost))
    assert r.badput == pytest.approx(0.042784, abs=2e-6)
    assert r.gpu_hours_per_day == pytest.approx(r.badput * 1000 * 24)
    assert r.checkpoint_badput == pytest.approx(r.badput - r.restart)


def test_tier_every_keeps_up_with_recoverability_and_floors() -> None:
    tiers = (
        TierConfig(name="local", serves_fraction=0.5, time_to_recoverable_s=2, reload_s=0),
        TierConfig(name="replica", serves_fraction=0.4, time_to_recoverable_s=2, reload_s=0,
                   every=4),
        TierConfig(name="persistent", serves_fraction=0.1, time_to_recoverable_s=250, reload_s=0,
                   min_interval_s=1000),
    )
    cfg = ModelConfig(interruptions_per_day=5, blocking_s=1, tiers=tiers)
    assert tier_every(cfg, 100) == (1, 4, 10)
    assert tier_every(cfg, 2000) == (1, 4, 1)
    assert tier_every(cfg, 125) == (1, 4, 8)


def test_optimum_matches_the_exact_optimum_for_a_synchronous_save() -> None:
    lam = 5 / PER_DAY
    cfg = one_tier(10, rate=lam, reload_s=30, restart_s=100)
    r = optimize(cfg)
    assert r.interval_s == pytest.approx(m.exact_optimal_interval(10, lam), rel=0.01)
    assert r.badput == pytest.approx(m.exact_badput(r.interval_s, 10, 130, lam), rel=0.01)
    # Young's balance: at the optimum saving costs about what losing work costs
    assert 0.9 < r.save / r.lost < 1.1
    assert evaluate(cfg).interval_s == r.interval_s  # interval None = optimal


def test_optimum_respects_the_shortest_interval() -> None:
    # saves that cost nothing would be taken continuously; tier 0's recoverability and
    # the step time bound the interval from below
    cfg = one_tier(0.0, rate=20 / PER_DAY, recoverable=3.0)
    assert optimize(cfg).interval_s == pytest.approx(3.0)
    cfg = one_tier(0.0, rate=20 / PER_DAY, recoverable=0.1)
    assert optimize(cfg).interval_s == pytest.approx(1.0)  # min_interval_s


def test_configs_are_validated() -> None:
    t = TierConfig(name="a", serves_fraction=0.5, time_to_recoverable_s=1, reload_s=1)
    with pytest.raises(ValueError, match="sum to 1"):
        ModelConfig(interruptions_per_day=1, blocking_s=0, tiers=(t,))
    with pytest.raises(ValueError, match="time_to_recoverable_s must be >= blocking_s"):
        one_tier(5, rate=1e-4, recoverable=1)
    with pytest.raises(ValueError, match="tier 0 receives every save"):
        ModelConfig(interruptions_per_day=1, blocking_s=0,
                    tiers=(TierConfig(name="a", serves_fraction=1, time_to_recoverable_s=1,
                                      reload_s=1, every=2),))
    with pytest.raises(ValueError, match="serves_fraction"):
        TierConfig(name="a", serves_fraction=1.5, time_to_recoverable_s=1, reload_s=1)
    with pytest.raises(ValueError, match="interruptions_per_day"):
        one_tier(1, rate=0.0)


@pytest.mark.parametrize("module", ["model", "simulate", "scenarios", "events", "reader", "report"])
def test_pure_modules_do_not_import_torch(module: str) -> None:
    import incluster.goodput as pkg

    src = Path(pkg.__file__).with_name(f"{module}.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    # only goodput's own modules: the rest of incluster imports torch
    assert {n for n in names if n.startswith("incluster")} <= {
        n for n in names if n.startswith("incluster.goodput")}
    top = {n.split(".")[0] for n in names}
    assert "torch" not in top
    assert top <= {"__future__", "math", "json", "dataclasses", "pathlib", "typing", "os",
                   "threading", "time", "collections", "atexit", "weakref", "numpy", "rich", "incluster",
                   "re", "uuid"}


def test_optimum_is_no_worse_than_a_dense_scan() -> None:
    # badput jumps where a tier's k_i changes; the optimiser must not miss those edges
    tiers = (
        TierConfig(name="local", serves_fraction=0.3, time_to_recoverable_s=0.3, reload_s=0.3),
        TierConfig(name="replica", serves_fraction=0.65, time_to_recoverable_s=1.7, reload_s=1.7),
        TierConfig(name="persistent", serves_fraction=0.05, time_to_recoverable_s=10.3,
                   reload_s=10.3),
    )
    for rate in (1, 5, 20):
        cfg = ModelConfig(interruptions_per_day=rate, blocking_s=0.0006, tiers=tiers)
        best = optimize(cfg).badput
        scan = min(evaluate(cfg, 1.0 + i * 0.01).badput for i in range(3000))
        assert best <= scan + 1e-12
