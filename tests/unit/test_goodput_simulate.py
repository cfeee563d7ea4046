"""goodput.simulate: the Monte Carlo job agrees with the model.

Stated tolerance: for a synchronous save the simulator matches the *exact* model within
4 standard errors; elsewhere it matches the first-order model within 4 standard errors
plus 2 % of the model's value (the model drops terms of order (lambda P)^2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from incluster.goodput import model as m
from incluster.goodput.model import ModelConfig, TierConfig, evaluate
from incluster.goodput.scenarios import CONFIGURATIONS, INCLUSTER, Costs, build
from incluster.goodput.simulate import simulate

PER_DAY = 86400.0

SYNC = ModelConfig(
    interruptions_per_day=PER_DAY / 3000, blocking_s=10, restart_s=40, interval_s=290,
    tiers=(TierConfig(name="persistent", serves_fraction=1, time_to_recoverable_s=10,
                      reload_s=20),),
)
THREE = ModelConfig(
    interruptions_per_day=PER_DAY / 5000, blocking_s=1, restart_s=50, interval_s=99,
    tiers=(
        TierConfig(name="local", serves_fraction=0.5, time_to_recoverable_s=2, reload_s=5),
        TierConfig(name="replica", serves_fraction=0.4, time_to_recoverable_s=30, reload_s=20),
        TierConfig(name="persistent", serves_fraction=0.1, time_to_recoverable_s=250,
                   reload_s=100),
    ),
)


def test_synchronous_save_matches_the_exact_model() -> None:
    sim = simulate(SYNC, expected_failures=40000, seed=11)
    exact = m.exact_badput(290, 10, 60, 1 / 3000)  # 0.099062
    assert sim.badput_stderr < 0.001
    assert abs(sim.badput - exact) < 4 * sim.badput_stderr
    assert 38000 < sim.failures < 42000
    assert sim.save + sim.lost + sim.restart + sim.reload == pytest.approx(sim.badput)


def test_three_tiers_match_the_model() -> None:
    sim = simulate(THREE, expected_failures=40000, seed=3)
    model = evaluate(THREE)  # 0.042784 by hand (test_goodput_model)
    assert sim.tier_every == model.tier_every == (1, 1, 3)
    assert abs(sim.badput - model.badput) < 4 * sim.badput_stderr + 0.02 * model.badput
    assert sim.save == pytest.approx(model.save, rel=0.01)
    assert sim.restart == pytest.approx(model.restart, rel=0.03)
    assert sim.reload == pytest.approx(model.reload, rel=0.05)


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_figure_configurations_match_the_model_at_20_a_day(name: str) -> None:
    cfg = build(name, Costs(), state_gib=1, interruptions_per_day=20, include_restart=False)
    model = m.optimize(cfg)
    sim = simulate(cfg, interval_s=model.interval_s, expected_failures=40000, seed=5)
    assert abs(sim.badput - model.badput) < 4 * sim.badput_stderr + 0.02 * model.badput


def test_the_simulator_sees_a_wrong_interval() -> None:
    # the model's optimum beats 4x the interval in simulation too
    best = m.optimize(replace(SYNC, interval_s=None))
    good = simulate(SYNC, interval_s=best.interval_s, expected_failures=20000, seed=1)
    bad = simulate(SYNC, interval_s=4 * best.interval_s, expected_failures=20000, seed=1)
    assert bad.badput > good.badput + 10 * good.badput_stderr


def test_seeded_and_reproducible() -> None:
    a = simulate(THREE, expected_failures=2000, seed=7)
    assert a == simulate(THREE, expected_failures=2000, seed=7)
    assert a.badput != simulate(THREE, expected_failures=2000, seed=8).badput
    with pytest.raises(ValueError, match="runs"):
        simulate(THREE, runs=1)


def test_uses_the_model_optimum_when_no_interval_is_given() -> None:
    cfg = build(INCLUSTER, Costs(), state_gib=2, interruptions_per_day=5)
    sim = simulate(cfg, expected_failures=200, seed=0)
    assert sim.interval_s == pytest.approx(m.optimize(cfg).interval_s)
