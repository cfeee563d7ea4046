"""``incluster goodput``: report a recorded run, plan a job's intervals, draw the figures.

Registered into the top-level parser by ``incluster.cli`` through ``register``; each
sub-command sets ``func`` (args -> exit status). Output is rich tables, or JSON with
``--json``. Errors the user can fix (a missing folder, a bad costs file) print one line and
return 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any, Callable

from incluster.goodput import scenarios
from incluster.goodput.model import ModelConfig, ModelResult, evaluate, young_interval
from incluster.goodput.scenarios import CONFIGURATIONS, INCLUSTER, Costs


def _finite(text: str) -> float:
    """A flag's number: nan and inf are refused (argparse names the flag)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return x


def _costs_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("costs (defaults: measured medians; docs/goodput.md names the source of each)")
    g.add_argument("--costs", metavar="FILE", help="JSON object of cost name: number")
    for key in Costs.keys():
        g.add_argument(f"--{key.replace('_', '-')}", dest=f"cost_{key}", type=_finite,
                       metavar="X", help=f"default {getattr(Costs(), key):g}")
    g.add_argument("--state-gib", type=_finite, default=1.0,
                   help="checkpointed state per rank in GiB (default 1)")


def _costs(args: argparse.Namespace) -> Costs:
    costs = Costs.from_json(args.costs) if args.costs else Costs()
    flags = {k: getattr(args, f"cost_{k}") for k in Costs.keys()}
    try:
        return costs.updated({k: v for k, v in flags.items() if v is not None})
    except ValueError as exc:  # name the flags, not the fields
        text = str(exc)
        for k in Costs.keys():
            if flags[k] is not None:
                text = text.replace(f"cost {k} ", f"--{k.replace('_', '-')} ")
        raise ValueError(text) from None


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ValueError, ImportError, OSError) as exc:
            print(f"incluster goodput: {exc}", file=sys.stderr)
            return 2

    return run


def _secs(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def cmd_report(args: argparse.Namespace) -> int:
    """Print the goodput report of a run folder."""
    from incluster.goodput.report import build_report, render

    report = build_report(args.run_dir)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return 0


def plan_config(args: argparse.Namespace) -> ModelConfig:
    """The model config ``plan`` evaluates: a named configuration with the user's overrides."""
    if not args.interruptions_per_day > 0:
        raise ValueError(f"--interruptions-per-day must be > 0, got {args.interruptions_per_day:g}")
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    cfg = scenarios.build(args.config, _costs(args), state_gib=args.state_gib,
                          interruptions_per_day=args.interruptions_per_day, gpus=args.gpus)
    if args.persistent_every is not None:
        if not any(t.name == "persistent" and i > 0 for i, t in enumerate(cfg.tiers)):
            raise ValueError(f"--persistent-every applies to a persistent tier beside faster ones "
                             f"(--config {INCLUSTER}); in {args.config!r} every save goes to persistent "
                             f"storage: leave it out")
        if args.persistent_every < 1:
            raise ValueError(f"--persistent-every must be >= 1, got {args.persistent_every}")
        tiers = tuple(
            replace(t, every=args.persistent_every) if t.name == "persistent" and i > 0 else t
            for i, t in enumerate(cfg.tiers)
        )
        cfg = replace(cfg, tiers=tiers)
    if args.interval_s is not None:
        if not args.interval_s > 0:
            raise ValueError(f"--interval-s must be > 0, got {args.interval_s:g}")
        cfg = replace(cfg, interval_s=args.interval_s)
    return cfg


def plan_warnings(cfg: ModelConfig, r: ModelResult) -> list[str]:
    """Where the plan asked for cannot be kept, or the model is outside its range."""
    out = []
    tau = r.interval_s
    if tau < cfg.min_interval_s:
        out.append(f"an interval of {tau:g} s is under the shortest one possible ({cfg.min_interval_s:g} s: a "
                   f"step); saves come between steps")
    t0 = cfg.tiers[0]
    if tau + cfg.blocking_s < t0.time_to_recoverable_s:
        out.append(f"the {t0.name} tier takes every save but a save is ready there only "
                   f"{t0.time_to_recoverable_s:.2f} s after it starts: saves {tau:g} s apart would wait for "
                   f"the one before (save() blocks), which the model does not count")
    for t, k, period in zip(cfg.tiers[1:], r.tier_every[1:], r.tier_interval_s[1:]):
        if period < t.time_to_recoverable_s * (1 - 1e-9):
            out.append(f"the {t.name} tier gets one save in {k} ({period:.2f} s apart) but a save is ready there "
                       f"only {t.time_to_recoverable_s:.2f} s after it starts: incluster skips an upload while the "
                       f"last one runs, so fewer saves reach it than planned, and its lost work is more than shown "
                       f"(raise --persistent-every to at least {math.ceil(t.time_to_recoverable_s / period * k)})")
    every = 1 / cfg.rate_per_s
    if cfg.rate_per_s * (tau + cfg.blocking_s) > 0.5:
        out.append(f"failures come every {_secs(every)} on average, within about two intervals: the "
                   f"first-order model (Young/Daly) is outside its range and its numbers are rough at best")
    if r.badput >= 1.0:
        fix = ("save more often (leave out --interval-s for the best interval)" if cfg.interval_s is not None
               else "no interval does better: saves are already a step apart, so the job needs fewer failures or "
                    "cheaper saves and restarts")
        out.append(f"the model's badput adds up to {100 * r.badput:.0f} % at this interval: read it as a job that "
                   f"makes no progress; {fix}")
    return out


def _pct(share: float) -> str:
    """A share in percent, never "-0.000"."""
    v = 100 * share
    return f"{0.0 if abs(v) < 5e-4 else v:.3f}"


def _result_dict(cfg: ModelConfig, r: ModelResult) -> dict[str, Any]:
    return {
        "interval_s": r.interval_s,
        "young_interval_s": (
            young_interval(cfg.blocking_s, cfg.rate_per_s) if cfg.blocking_s else None
        ),
        "blocking_s": cfg.blocking_s,
        "tiers": [
            {"name": t.name, "serves_fraction": t.serves_fraction,
             "time_to_recoverable_s": t.time_to_recoverable_s, "reload_s": t.reload_s,
             "every": k, "interval_s": iv, "lost_per_failure_s": lost}
            for t, k, iv, lost in zip(cfg.tiers, r.tier_every, r.tier_interval_s,
                                      r.lost_per_failure_s)
        ],
        "badput_pct": {"checkpoint_save": 100 * r.save, "lost_progress": 100 * r.lost,
                       "restart": 100 * r.restart, "checkpoint_load": 100 * r.reload,
                       "total": 100 * r.badput},
        "gpu_hours_per_day": r.gpu_hours_per_day,
    }


def cmd_plan(args: argparse.Namespace) -> int:
    """Recommend an interval per tier and print the expected badput."""
    cfg = plan_config(args)
    result = evaluate(cfg)
    costs = _costs(args)
    configs = {
        name: scenarios.build(name, costs, state_gib=args.state_gib,
                              interruptions_per_day=args.interruptions_per_day, gpus=args.gpus)
        for name in CONFIGURATIONS
    }
    compare = {name: evaluate(c) for name, c in configs.items()}
    if args.json:
        out = {"config": args.config, "gpus": args.gpus, "state_gib": args.state_gib,
               "interruptions_per_day": args.interruptions_per_day,
               "costs": costs.to_dict(),
               "plan": _result_dict(cfg, result),
               "warnings": plan_warnings(cfg, result),
               "compare": {n: {**_result_dict(configs[n], r), "warnings": plan_warnings(configs[n], r)}
                           for n, r in compare.items()}}
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    steps = result.interval_s / costs.step_s
    t = Table(title=f"plan: {args.config}; {args.gpus} GPUs, {args.interruptions_per_day:g} "
                    f"interruptions/day, {args.state_gib:g} GiB/rank")
    for col in ("tier", "serves", "ready after", "reload", "keeps", "period", "lost/fail"):
        t.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    for tier, k, iv, lost in zip(cfg.tiers, result.tier_every, result.tier_interval_s,
                                 result.lost_per_failure_s):
        t.add_row(tier.name, f"{100 * tier.serves_fraction:.0f} %",
                  f"{tier.time_to_recoverable_s:.2f} s", f"{tier.reload_s:.2f} s",
                  "all" if k == 1 else f"1 in {k}", f"{iv:.1f} s", f"{lost:.1f} s")
    con.print(t)
    con.print(f"save every {result.interval_s:.1f} s of compute (~{steps:.0f} steps at "
              f"{costs.step_s:g} s/step); each save blocks {_secs(cfg.blocking_s)}; a tier's period is the "
              f"time between the saves it keeps, blocking included")
    for w in plan_warnings(cfg, result):
        con.print(f"[yellow]warning:[/] {w}")
    b = Table(title="expected badput")
    for col in ("category", "% of GPU time", "GPU-hours/day"):
        b.add_column(col, justify="left" if col == "category" else "right")
    gh = args.gpus * 24.0
    for name, share in (("checkpoint save", result.save), ("lost progress", result.lost),
                        ("checkpoint load", result.reload), ("restart", result.restart),
                        ("total", result.badput)):
        b.add_row(name, _pct(share), f"{share * gh:.1f}")
    con.print(b)
    c = Table(title="each configuration at its optimal interval")
    for col in ("configuration", "interval", "total %", "ckpt %", "GPU-h/day"):
        c.add_column(col, justify="left" if col == "configuration" else "right")
    outside: list[str] = []
    for name, r in compare.items():
        flagged = plan_warnings(configs[name], r)
        outside += [f"{name}: {w}" for w in flagged]
        c.add_row(name + (" [yellow](!)[/]" if flagged else ""), f"{r.interval_s:.1f} s", _pct(r.badput),
                  _pct(r.checkpoint_badput), f"{r.gpu_hours_per_day:.1f}")
    con.print(c)
    for w in outside:  # a row outside the model's range is no figure to plan by
        con.print(f"[yellow]warning:[/] {w}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw the goodput figure and print its numbers."""
    from incluster.goodput.plot import plot_figure

    args.output = _png(args.output, "goodput.png")
    curves = plot_figure(args.output, _costs(args), state_gib=args.state_gib,
                         log_scale=not args.linear)
    if args.json:
        print(json.dumps({"rates": list(range(1, 21)), "badput_pct": curves}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"badput % from checkpointing ({args.output})")
    t.add_column("configuration")
    for rate in (1, 5, 10, 20):
        t.add_column(f"{rate}/day", justify="right")
    for name, ys in curves.items():
        t.add_row(name, *(f"{ys[rate - 1]:.3f}" for rate in (1, 5, 10, 20)))
    Console().print(t)
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    """Draw a recorded run's events per rank over time."""
    from incluster.goodput.plot import plot_timeline

    out = _png(args.output, "timeline.png")
    n = plot_timeline(args.run_dir, out)
    print(f"wrote {out} ({n} events)")
    return 0


def _png(output: str, name: str) -> str:
    """Where ``-o`` writes: a folder gets ``name`` in it, a path without a suffix ``.png``
    (what matplotlib would add without saying so)."""
    import os

    if os.path.isdir(output):
        return os.path.join(output, name)
    return output if os.path.splitext(output)[1] else output + ".png"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``goodput`` and its sub-commands to the top-level ``incluster`` parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "goodput", help="goodput report, interval planning, figures",
        description=(__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="goodput_command", metavar="SUBCOMMAND", required=True)

    r = sub.add_parser("report", help="where a recorded run's time went")
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.add_argument("--json", action="store_true", help="print JSON instead of tables")
    r.set_defaults(func=_guard(cmd_report))

    pl = sub.add_parser("plan", help="recommended interval per tier and expected badput")
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--interruptions-per-day", type=_finite, required=True)
    pl.add_argument("--config", choices=CONFIGURATIONS, default=INCLUSTER,
                    help=f"configuration to plan (default {INCLUSTER!r})")
    pl.add_argument("--interval-s", type=_finite, help="evaluate this interval instead")
    pl.add_argument("--persistent-every", type=int, help="fix every how many saves persist")
    pl.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _costs_flags(pl)
    pl.set_defaults(func=_guard(cmd_plan))

    f = sub.add_parser("plot", help="the goodput figure: badput vs interruptions per day")
    f.add_argument("-o", "--output", required=True, metavar="PNG")
    f.add_argument("--linear", action="store_true", help="linear y axis (default log)")
    f.add_argument("--json", action="store_true", help="print the curves as JSON")
    _costs_flags(f)
    f.set_defaults(func=_guard(cmd_plot))

    tl = sub.add_parser("timeline", help="a recorded run's events per rank over time")
    tl.add_argument("run_dir", metavar="RUN_DIR")
    tl.add_argument("-o", "--output", required=True, metavar="PNG")
    tl.set_defaults(func=_guard(cmd_timeline))
    return p


__all__ = ["cmd_plan", "cmd_plot", "cmd_report", "cmd_timeline", "plan_config", "register"]
