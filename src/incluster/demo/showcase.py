"""``incluster showcase``: a short, single-process tour of save and restore, with timings.

Trains a small model for a few steps, saving asynchronously, then "crashes" (drops the
model), builds a fresh one, restores it from the RAM disk, checks it bitwise, and prints
what each part cost against the floor (one plain copy of the same bytes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

from incluster.demo import at_least

if TYPE_CHECKING:
    import torch


def register(sub: Any) -> None:
    p = sub.add_parser("showcase", help="single-process save/restore tour with timings")
    p.add_argument("--mib", type=at_least(1), default=256, help="approximate state size in MiB (default 256)")
    p.add_argument("--steps", type=at_least(1), default=12, help="training steps (default 12)")
    p.add_argument("--every", type=at_least(1), default=3, help="save every N steps (default 3)")
    p.add_argument("--local-dir", default=None, help="RAM-disk folder (default: a temporary one in /dev/shm)")
    p.set_defaults(func=run)


def _model(mib: int) -> torch.nn.Module:
    import torch

    width = 1024
    layers = max(1, (mib * 2**20) // (3 * 4 * width * width))  # params + AdamW's two moments
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _floor_copy(nbytes: int) -> tuple[float, float]:
    """Seconds to copy ``nbytes`` with one ``copy_``: into memory touched before (median of
    3), and into fresh memory, page faults included (what a restarted process pays)."""
    import torch

    src = torch.ones(nbytes // 4)
    t = time.perf_counter()
    dst = torch.empty_like(src)
    dst.copy_(src)
    fresh = time.perf_counter() - t
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times), fresh


def run(args: argparse.Namespace) -> int:
    import torch

    from rich.console import Console
    from rich.table import Table

    import incluster

    con = Console()
    base = args.local_dir or tempfile.mkdtemp(prefix="incluster-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        model = _model(args.mib)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state: dict[str, Any] = {"model": model, "optim": optim, "progress": {"step": 0, "tokens": 0}}
        ckpt = incluster.Checkpointer(local_dir=base, job="demo")
        con.print(f"[bold]incluster showcase[/] — RAM-disk folder {ckpt.folder}")
        handles = []
        for step in range(args.steps):
            x = torch.randn(32, 1024)
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()  # waits for the previous save's copy (pre-step hook)
            optim.zero_grad()
            state["progress"] = {"step": step, "tokens": (step + 1) * 32}
            if step == 0:  # the optimizer's state exists now: slots and the writer process made ready
                t = time.perf_counter()
                ckpt.prepare(state).result(120)  # a real loop trains on meanwhile; waited for here to time saves alone
                con.print(f"  prepared the slots and the writer process (it started with the Checkpointer) "
                          f"in {time.perf_counter() - t:.2f} s")
            save_now = step % args.every == 0 or step == args.steps - 1
            if save_now:
                handles.append(ckpt.save(step, state))
            con.print(f"  step {step:3d}  loss {loss.item():.5f}" + ("  [green]saved[/]" if save_now else ""))
        ckpt.wait()
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        nbytes += sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if torch.is_tensor(v))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        last = handles[-1].step
        ckpt.close()

        con.print("\n[bold]Crash![/] dropping the model and optimizer; building fresh ones and restoring…")
        model2 = _model(args.mib)
        optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        state2: dict[str, Any] = {"model": model2, "optim": optim2, "progress": {}}
        t = time.perf_counter()
        ckpt2 = incluster.Checkpointer(local_dir=base, job="demo")
        start_s = time.perf_counter() - t
        t = time.perf_counter()
        restored = ckpt2.load(state2)
        load_s = time.perf_counter() - t
        same = all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
        ckpt2.close()
        floor, fresh = _floor_copy(nbytes)

        table = Table(title=f"{nbytes / 2**20:.0f} MiB state, {len(handles)} saves (median of saves after the first)")
        table.add_column("what")
        table.add_column("seconds", justify="right")
        table.add_column("x floor copy", justify="right")
        later = handles[1:] or handles
        # Saves made while the writer process starts may be given up for newer ones: they
        # have no durable time (counted as 0 s, they made the first save look free).
        durable = [h for h in handles if h.durable_s is not None]
        given_up = [h.step for h in handles if h.durable_s is None]

        def row(name: str, vals: list[float]) -> None:
            v = statistics.median(vals)
            table.add_row(name, f"{v:.4f}", f"{v / floor:.2f}")

        row("floor: one copy_ of the same bytes", [floor])
        row(f"first durable save (step {durable[0].step}, after prepare()): copy + commit",
            [durable[0].durable_s or 0.0])
        row("save() blocked the training loop", [h.blocked_s or 0.0 for h in later])
        row("until staged (tensors free to change)", [h.staged_s or 0.0 for h in later if h.staged_s is not None])
        if len(durable) > 1:
            row("until durable (checksummed, committed)", [h.durable_s or 0.0 for h in durable[1:]])
        table.add_row("floor: the same copy into fresh memory (faults)", f"{fresh:.4f}", f"{fresh / floor:.2f}")
        table.add_row("restore into fresh tensors (x the fresh floor)", f"{load_s:.4f}", f"{load_s / fresh:.2f}")
        table.add_row("before it: a Checkpointer (its writer starts in the background)", f"{start_s:.4f}", "")
        con.print(table)
        if given_up:
            con.print(f"step(s) {', '.join(map(str, given_up))}: given up for newer saves while the writer process "
                      f"started (a fresh interpreter importing torch); not counted above")
        con.print(f"restored step {restored} (last saved {last}); progress {state2['progress']}; "
                  f"model bitwise equal: {'[green]yes[/]' if same else '[red]NO[/]'}")
        return 0 if same and restored == last else 1
    finally:
        if not args.local_dir:
            shutil.rmtree(base, ignore_errors=True)
