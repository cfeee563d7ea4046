"""Figures: the badput-vs-interruptions figure, and a recorded run's timeline.

matplotlib is an optional extra (``pip install incluster[plot]``) and is imported only when
a figure is drawn, with the Agg backend (files, no display). The numbers come from
``goodput.scenarios`` (the figure) and ``goodput.report`` (the timeline); nothing here
computes anything a test could not check without matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from incluster.goodput import events as ev
from incluster.goodput.reader import read_run
from incluster.goodput.scenarios import CONFIGURATIONS, Costs, figure_data


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "drawing figures needs matplotlib: install incluster[plot] "
            "(pip install 'incluster[plot]')"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_figure(
    out_png: str | Path,
    costs: Costs | None = None,
    *,
    state_gib: float = 1.0,
    rates: tuple[float, ...] = tuple(range(1, 21)),
    log_scale: bool = True,
) -> dict[str, list[float]]:
    """Draw badput % from checkpointing against interruptions per day; return the curves.

    One curve per configuration, each at its optimal interval (``model.optimize``);
    restart time is left out because no checkpointing configuration changes it.
    """
    costs = costs or Costs()
    data = figure_data(costs, state_gib=state_gib, rates=rates)
    curves = {name: [100.0 * r.checkpoint_badput for r in data[name]] for name in CONFIGURATIONS}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name in CONFIGURATIONS:
        ax.plot(rates, curves[name], marker="o", markersize=3, label=name)
    ax.set_xlabel("interruptions per day")
    ax.set_ylabel("badput from checkpointing, % of GPU time")
    if log_scale:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_percent_formatter())
    ax.set_xticks([r for r in rates if r == rates[0] or r % 5 == 0])
    ax.set_title(
        f"Each configuration at its optimal interval; {state_gib:g} GiB per rank, "
        f"{costs.persistent_gib_per_s:g} GiB/s per rank to storage",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return curves


def _percent_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda y, _pos: f"{y:g}")


_COLORS = {
    ev.SAVE: "tab:blue",
    ev.DURABLE: "tab:green",
    ev.LOAD: "tab:orange",
    ev.START: "tab:purple",
    ev.SAVE_FAILED: "tab:red",
}


def plot_timeline(run_dir: str | Path, out_png: str | Path) -> int:
    """Draw a recorded run's events per rank over time; return the number of events drawn.

    Each attempt is a grey bar from its start to its last event; saves are blue ticks
    (width: time blocked), durable events green dots, loads orange bars, restarts purple
    triangles, failed saves red crosses, an attempt that ended without ``end`` and was
    followed by another (a failure) a black cross at its last event, and a rank's last
    attempt without ``end`` (killed, or still running when read) a hollow black circle. An
    attempt followed by any rank's later one is a failure: after a restart into fewer
    ranks the old rank numbers have no later attempt of their own.
    """
    runs = read_run(run_dir)
    t0 = min(a.start_t for attempts in runs.values() for a in attempts)
    starts = sorted(a.start_t for attempts in runs.values() for a in attempts)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * len(runs)), dpi=120)
    drawn = 0
    seen: set[str] = set()

    def label(name: str) -> str | None:
        if name in seen:
            return None
        seen.add(name)
        return name

    for y, (rank, attempts) in enumerate(runs.items()):
        for a in attempts:
            ax.broken_barh([(a.start_t - t0, a.last_t - a.start_t)], (y - 0.3, 0.6),
                           color="0.85", label=label("attempt"))
            for e in a.events:
                x = float(e["t"]) - t0
                kind = e["kind"]
                if kind == ev.SAVE:
                    width = max(float(e.get("blocked_s") or 0.0), 1e-9)
                    ax.broken_barh([(x - width, width)], (y - 0.3, 0.6),
                                   color=_COLORS[kind], label=label("save (blocked)"))
                    ax.plot([x, x], [y - 0.3, y + 0.3], color=_COLORS[kind], lw=0.8)
                elif kind == ev.DURABLE:
                    ax.plot(x, y + 0.35, ".", color=_COLORS[kind], label=label("durable"))
                elif kind == ev.LOAD:
                    secs = float(e.get("seconds") or 0.0)
                    ax.broken_barh([(x - secs, secs)], (y - 0.3, 0.6), color=_COLORS[kind],
                                   label=label("load"))
                elif kind == ev.START and a is not attempts[0]:
                    ax.plot(x, y, "^", color=_COLORS[kind], label=label("restart"))
                elif kind == ev.SAVE_FAILED and e.get("superseded"):  # a newer save took its place: no failure
                    ax.plot(x, y - 0.15, "|", color="0.45", label=label("given up for a newer save"))
                elif kind == ev.SAVE_FAILED:
                    ax.plot(x, y, "x", color=_COLORS[kind], label=label("save failed"))
                else:
                    continue
                drawn += 1
            followed = a is not attempts[-1] or any(t > a.last_t for t in starts)  # by any rank's restart
            if not a.ended and followed:
                ax.plot(a.last_t - t0, y, "kx", markersize=9, label=label("failure"))
                drawn += 1
            elif not a.ended:
                ax.plot(a.last_t - t0, y, "o", color="k", mfc="none", markersize=8,
                        label=label("no end (killed, or running)"))
                drawn += 1
    ax.set_yticks(range(len(runs)), [f"rank {r}" for r in runs])
    ax.set_xlabel("seconds since the run began")
    ax.set_title(f"events of {run_dir}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return drawn


__all__ = ["plot_figure", "plot_timeline"]
