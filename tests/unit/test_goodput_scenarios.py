"""goodput.scenarios: the figure's configurations from DESIGN §1 costs, and its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from incluster.goodput import model as m
from incluster.goodput.scenarios import (
    ASYNC,
    CONFIGURATIONS,
    INCLUSTER,
    PINNED,
    SYNC,
    WRITER,
    Costs,
    build,
    figure_data,
)


def shape(cfg: m.ModelConfig) -> dict[str, list[float]]:
    """name -> [serves, L, T] per tier, and "blocking" -> [delta]."""
    out = {t.name: [t.serves_fraction, t.time_to_recoverable_s, t.reload_s] for t in cfg.tiers}
    return {"blocking": [cfg.blocking_s], **out}


def test_configurations_for_2_gib_by_hand() -> None:
    # W = 2 GiB / 0.1 GiB/s = 20 s to or from persistent storage
    c, kw = Costs(), dict(state_gib=2, interruptions_per_day=5)
    sync = build(SYNC, c, **kw)
    assert shape(sync) == {"blocking": [pytest.approx(2 * 0.74 + 20)],
                           "persistent": pytest.approx([1, 21.48, 2 * 0.66 + 20])}
    assert sync.restart_s == 120
    assert shape(build(ASYNC, c, **kw)) == {"blocking": [pytest.approx(0.88)],
                                            "persistent": pytest.approx([1, 22.48, 21.32])}
    assert shape(build(PINNED, c, **kw)) == {"blocking": [pytest.approx(0.026)],
                                             "persistent": pytest.approx([1, 22.0, 21.32])}
    assert shape(build(WRITER, c, **kw)) == {"blocking": [pytest.approx(0.0012)],
                                             "persistent": pytest.approx([1, 20.6, 20.6])}
    assert shape(build(INCLUSTER, c, **kw)) == {
        "blocking": [pytest.approx(0.0012)],
        "local": pytest.approx([0.3, 0.6, 0.6]),
        "replica": pytest.approx([0.65, 3.4, 3.4]),
        "persistent": pytest.approx([0.05, 20.6, 20.6]),
    }
    assert build(SYNC, c, **kw, include_restart=False).restart_s == 0


def test_each_step_of_the_talk_lowers_badput_at_every_rate() -> None:
    data = figure_data(Costs())
    for r in range(20):
        curve = [data[name][r].checkpoint_badput for name in CONFIGURATIONS]
        assert curve == sorted(curve, reverse=True) and len(set(curve)) == 5


def test_default_figure_numbers() -> None:
    """The numbers quoted in docs/goodput.md and the issue note (badput %, 1/5/10/20 a day)."""
    data = figure_data(Costs())
    quoted = {
        SYNC: [1.583, 3.554, 5.041, 7.156],
        ASYNC: [0.344, 0.836, 1.253, 1.913],
        PINNED: [0.080, 0.248, 0.423, 0.745],
        WRITER: [0.036, 0.155, 0.304, 0.601],
        INCLUSTER: [0.016, 0.047, 0.079, 0.137],
    }
    for name, values in quoted.items():
        got = [100 * data[name][r - 1].checkpoint_badput for r in (1, 5, 10, 20)]
        assert got == pytest.approx(values, abs=6e-4), name


def test_sync_curve_is_the_exact_model_at_its_optimum() -> None:
    lam = 5 / m.SECONDS_PER_DAY
    sync = figure_data(Costs(), rates=(5,))[SYNC][0]
    delta, reload_s = 0.74 + 10, 0.66 + 10
    tau = m.exact_optimal_interval(delta, lam)
    assert sync.interval_s == pytest.approx(tau, rel=0.01)
    exact = m.exact_badput(tau, delta, reload_s, lam)
    assert sync.checkpoint_badput == pytest.approx(exact, rel=0.01)


def test_costs_from_json_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "costs.json"
    f.write_text(json.dumps({"persistent_gib_per_s": 1.0, "restart_s": 30}))
    c = Costs.from_json(f)
    assert (c.persistent_gib_per_s, c.restart_s, c.sync_save_s_per_gib) == (1.0, 30.0, 0.74)
    assert build(SYNC, c, state_gib=1, interruptions_per_day=1).blocking_s == pytest.approx(1.74)
    f.write_text(json.dumps({"persistent_gbps": 1.0}))
    with pytest.raises(ValueError, match="unknown cost.*persistent_gbps"):
        Costs.from_json(f)
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Costs.from_json(f)
    for v in ("soon", "60", True):  # a quoted number or a boolean in a costs file is a mistake, not a number
        with pytest.raises(ValueError, match=f"cost restart_s must be a number, not {v!r}"):
            Costs().updated({"restart_s": v})
    with pytest.raises(ValueError, match="serve_local"):
        Costs(serve_local=0.5, serve_replica=0.6)
    with pytest.raises(ValueError, match="unknown configuration"):
        build("fast", Costs(), state_gib=1, interruptions_per_day=1)
