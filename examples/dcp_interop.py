"""DCP interop, both ways, in one process (run: python examples/dcp_interop.py).

1. A job saves with incluster; ``incluster export --to dcp`` turns a step into a standard
   torch.distributed.checkpoint folder, which plain ``dcp.load`` reads (resharding it to
   whatever layout the loading job uses).
2. A job that has a DCP checkpoint starts from it with ``load_dcp`` and goes on saving
   with incluster; a restart then resumes from incluster's own steps.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp

import incluster
from incluster.integrations.dcp import load_dcp


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> float:
    for _ in range(steps):
        x = torch.randn(64, 16)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return float(loss)


def main() -> None:
    ram = tempfile.mkdtemp(prefix="incluster-example-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="incluster-example-")
    try:
        # 1. incluster -> DCP
        model, optim = make()
        with incluster.Checkpointer(local_dir=ram, job="interop") as ckpt:
            train(model, optim, 5)
            ckpt.save(5, {"model": model, "optim": optim, "extra": {"tokens": 5 * 64}}).wait()
        out = f"{work}/step-5-dcp"
        subprocess.run([sys.executable, "-m", "incluster", "export", ram, "--step", "5", "--to", "dcp", out], check=True)
        plain, _ = make()
        dcp.load({"model": plain}, checkpoint_id=out)  # no incluster needed to read it
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
        print(f"exported step 5 to {out}; dcp.load read it back bitwise")

        # 2. DCP -> incluster: a fresh job seeded from that folder
        model2, optim2 = make()
        state = {"model": model2, "optim": optim2, "extra": {"tokens": 0}}
        with incluster.Checkpointer(local_dir=ram, job="seeded") as ckpt:
            start = ckpt.load(state)  # nothing under this job yet
            if start is None:
                start = load_dcp(state, out, step=5)  # AdamW moments included
            print(f"seeded from DCP at step {start}, tokens {state['extra']['tokens']}")
            loss = train(model2, optim2, 3)
            ckpt.save(start + 3, state).wait()
            print(f"trained to step {start + 3} (loss {loss:.4f}) and saved it with incluster")
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
