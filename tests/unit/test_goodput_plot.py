"""goodput.plot: the figure's file and numbers, the timeline, and the missing-extra error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from incluster.goodput.plot import plot_figure, plot_timeline
from incluster.goodput.scenarios import CONFIGURATIONS, Costs, figure_data

PNG = b"\x89PNG\r\n\x1a\n"


def test_figure_is_a_png_of_the_model_numbers(tmp_path: Path) -> None:
    out = tmp_path / "fig.png"
    costs = Costs(persistent_gib_per_s=0.5)
    curves = plot_figure(out, costs, state_gib=2)
    assert out.read_bytes()[:8] == PNG
    data = figure_data(costs, state_gib=2)
    assert list(curves) == list(CONFIGURATIONS)
    for name in CONFIGURATIONS:
        assert len(curves[name]) == 20
        assert curves[name] == pytest.approx([100 * r.checkpoint_badput for r in data[name]])


def write(run: Path, rank: int, pid: int, events: list[tuple]) -> None:
    text = "".join(json.dumps({"t": t, "kind": k, "rank": rank, "pid": pid, **f}) + "\n"
                   for t, k, f in events)
    (run / f"events-rank{rank:05d}-pid{pid}.jsonl").write_text(text)


def test_timeline_draws_every_event(tmp_path: Path) -> None:
    write(tmp_path, 0, 1, [(0, "start", {}), (2, "load", {"step": None, "seconds": 1}),
                           (3, "train_step", {"step": 0}),
                           (4, "save", {"step": 0, "blocked_s": 0.1}),
                           (5, "durable", {"step": 0, "tier": "local", "seconds": 1}),
                           (6, "save_failed", {"step": 1, "error": "disk full"})])
    write(tmp_path, 0, 2, [(9, "start", {}), (10, "load", {"step": 0, "seconds": 0.5}),
                           (11, "save", {"step": 1, "blocked_s": 0.1}), (12, "end", {})])
    write(tmp_path, 1, 3, [(0, "start", {}), (12, "end", {})])
    out = tmp_path / "timeline.png"
    # attempt 1: load, save, durable, save_failed, failure; attempt 2: restart, load, save
    assert plot_timeline(tmp_path, out) == 8
    assert out.read_bytes()[:8] == PNG


def test_a_save_given_up_for_a_newer_one_is_not_drawn_as_a_failure(tmp_path: Path, monkeypatch) -> None:
    """The report counts such saves apart ("given up for a newer save"); the timeline drew
    each as a red "save failed" cross."""
    from incluster.goodput import plot

    write(tmp_path, 0, 1, [(0, "start", {}), (1, "save_failed", {"step": 0, "error": "x", "superseded": True}),
                           (2, "save", {"step": 1, "blocked_s": 0.1}), (3, "end", {})])
    figs = []
    real = plot._pyplot

    def keeping():
        plt = real()
        monkeypatch.setattr(plt, "close", figs.append)
        return plt

    monkeypatch.setattr(plot, "_pyplot", keeping)
    plot_timeline(tmp_path, tmp_path / "timeline.png")
    labels = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert "given up for a newer save" in labels and "save failed" not in labels, labels


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"incluster\[plot\]"):
        plot_figure(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
