"""`incluster goodput ...` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from incluster.goodput import model as m
from incluster.goodput.scenarios import CONFIGURATIONS, INCLUSTER, Costs, build


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "incluster", "goodput", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_json_is_the_model(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"persistent_gib_per_s": 0.5}))
    p = run("plan", "--gpus", "1024", "--interruptions-per-day", "5", "--state-gib", "2",
            "--costs", str(costs), "--restart-s", "60", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    cfg = build(INCLUSTER, Costs(persistent_gib_per_s=0.5, restart_s=60), state_gib=2,
                interruptions_per_day=5, gpus=1024)
    want = m.optimize(cfg)
    assert out["plan"]["interval_s"] == pytest.approx(want.interval_s)
    assert out["plan"]["badput_pct"]["total"] == pytest.approx(100 * want.badput)
    assert [t["every"] for t in out["plan"]["tiers"]] == list(want.tier_every)
    assert out["plan"]["gpu_hours_per_day"] == pytest.approx(want.badput * 1024 * 24)
    assert list(out["compare"]) == list(CONFIGURATIONS)


def test_plan_table_and_fixed_interval() -> None:
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "5", "--interval-s", "60",
            "--persistent-every", "10")
    assert p.returncode == 0, p.stderr
    assert "expected badput" in p.stdout and "1 in 10" in p.stdout
    assert "save every 60.0 s" in p.stdout


def test_report_timeline_and_errors(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events-rank00000-pid5.jsonl").write_text(
        '{"t": 0, "kind": "start"}\n'
        '{"t": 4, "kind": "load", "step": null, "seconds": 1}\n'
        '{"t": 9.5, "kind": "save", "step": 5, "blocked_s": 0.5}\n'
        '{"t": 10, "kind": "end"}\n'
    )
    p = run("report", str(run_dir), "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    # restart: 4 - 0 - 1 load; goodput: 10 - 3 - 1 - 0.5
    assert rep["badput_s"]["restart"] == 3 and rep["goodput_s"] == pytest.approx(5.5)
    p = run("report", str(run_dir))
    assert p.returncode == 0 and "goodput" in p.stdout and "55.00 %" in p.stdout
    p = run("timeline", str(run_dir), "-o", str(tmp_path / "t.png"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    for given, written in ((tmp_path / "noext", tmp_path / "noext.png"), (tmp_path, tmp_path / "timeline.png")):
        p = run("timeline", str(run_dir), "-o", str(given))  # says the file it really wrote
        assert p.returncode == 0 and f"wrote {written} " in p.stdout and written.is_file(), (p.stdout, p.stderr)
    p = run("report", str(tmp_path / "missing"))
    assert p.returncode == 2 and "is not a folder" in p.stderr and "run_dir" in p.stderr
    (tmp_path / "empty").mkdir()
    p = run("report", str(tmp_path / "empty"))
    assert p.returncode == 2 and "no events" in p.stderr and "INCLUSTER_RUN_DIR" in p.stderr


def test_plot_writes_the_figure_and_prints_its_numbers(tmp_path: Path) -> None:
    out = tmp_path / "fig.png"
    p = run("plot", "-o", str(out), "--json", "--state-gib", "4")
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    curves = json.loads(p.stdout)["badput_pct"]
    want = m.optimize(build(CONFIGURATIONS[0], Costs(), state_gib=4, interruptions_per_day=20,
                            include_restart=False))
    assert curves[CONFIGURATIONS[0]][19] == pytest.approx(100 * want.checkpoint_badput)
    p = run("plot", "-o", str(out), "--costs", str(tmp_path / "nope.json"))
    assert p.returncode == 2 and "cannot read costs" in p.stderr


def test_plan_warns_where_the_interval_cannot_be_kept_or_the_model_does_not_hold() -> None:
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "5", "--interval-s", "0.1", "--json")
    assert p.returncode == 0, p.stderr
    warnings = json.loads(p.stdout)["warnings"]
    assert any("under the shortest one possible" in w for w in warnings)
    assert any("the local tier takes every save" in w for w in warnings)
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "100000")
    assert p.returncode == 0, p.stderr
    assert "outside its range" in " ".join(p.stdout.split()) and "-0.000" not in p.stdout
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "5", "--json")
    assert json.loads(p.stdout)["warnings"] == []


def test_plan_past_the_models_range_never_shows_a_negative_share_and_says_no_progress() -> None:
    """Hourly saves with failures every 29 min: the first-order terms gave a negative save
    badput and a total of 104 % without saying what that means."""
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "50", "--interval-s", "3600", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["plan"]["badput_pct"]["checkpoint_save"] >= 0
    assert any("makes no progress" in w for w in out["warnings"]), out["warnings"]


def test_plan_flags_each_compared_configuration_outside_the_models_range() -> None:
    """20,000 interruptions a day: the comparison rows said 118 % of GPU time (more GPU-hours
    a day than the GPUs have) with no word, in the table and in the JSON."""
    p = run("plan", "--gpus", "8", "--interruptions-per-day", "20000", "--restart-s", "1", "--json")
    assert p.returncode == 0, p.stderr
    compare = json.loads(p.stdout)["compare"]
    over = [n for n, r in compare.items() if r["badput_pct"]["total"] > 100]
    assert over and all(any("no progress" in w for w in compare[n]["warnings"]) for n in over), compare
    p = run("plan", "--gpus", "8", "--interruptions-per-day", "20000", "--restart-s", "1")
    assert p.returncode == 0, p.stderr
    assert all(f"{n}: " in " ".join(p.stdout.split()) for n in over), p.stdout


def test_plan_refuses_what_it_cannot_plan_naming_the_flag() -> None:
    """nan and inf printed tables of nan with exit 0; a negative cost was "not a number";
    --persistent-every was ignored where every save goes to persistent storage."""
    base = ("plan", "--gpus", "8", "--interruptions-per-day", "5")
    for extra, said in ((("--restart-s", "nan"), "--restart-s: must be a finite number"),
                        (("--interval-s", "nan"), "--interval-s: must be a finite number"),
                        (("--restart-s", "-1"), "--restart-s must be >= 0"),
                        (("--config", "async save", "--persistent-every", "5"), "--persistent-every applies to")):
        p = run(*base, *extra)
        assert p.returncode == 2 and said in p.stderr, (extra, p.returncode, p.stderr)
    p = run("plan", "--gpus", "8", "--interruptions-per-day", "inf")
    assert p.returncode == 2 and "--interruptions-per-day: must be a finite number" in p.stderr, p.stderr


def test_plan_warns_when_the_persistent_tier_cannot_take_the_saves_asked_for() -> None:
    """--persistent-every 1 asks for an upload every save, closer than an upload takes: the
    library skips uploads then, so the plan's lost work was optimistic and unflagged."""
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "5", "--persistent-every", "1", "--json")
    assert p.returncode == 0, p.stderr
    said = [w for w in json.loads(p.stdout)["warnings"] if "persistent tier gets one save in 1 " in w]
    assert said and "raise --persistent-every to at least" in said[0], json.loads(p.stdout)["warnings"]
    p = run("plan", "--gpus", "1000", "--interruptions-per-day", "1000000")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "leave out --interval-s" not in text and "no interval does better" in text, text
