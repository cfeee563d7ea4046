"""A Lightning fit that saves through incluster, then validate/test/predict from it
(run by test_lightning): ``lightning_eval.py OUT_JSON LOCAL_DIR``.

Writes whether each evaluation restored the fit's last step bitwise, and every WARNING
the incluster logger gave during it.
"""

from __future__ import annotations

import json
import logging
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from incluster.integrations.lightning import INCLUSTER, InclusterCheckpoint, InclusterDDPStrategy


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], _: int) -> None:
        return None

    def test_step(self, batch: list[torch.Tensor], _: int) -> None:
        return None

    def predict_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def trainer(local_dir: str, **kw: object) -> pl.Trainer:
    strategy = InclusterDDPStrategy(checkpointer=dict(local_dir=local_dir, job="evals", replicas=0),
                                    process_group_backend="gloo")
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False,
                      callbacks=[InclusterCheckpoint(every_n_steps=3)], **kw)  # type: ignore[arg-type]


def main() -> int:
    out, local_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    fitted = Net()
    trainer(local_dir, max_steps=6).fit(fitted, data)
    want = {k: v.clone() for k, v in fitted.state_dict().items()}
    seen = Warnings()
    logging.getLogger("incluster").addHandler(seen)
    result = {}
    for fn in ("validate", "test", "predict"):
        seen.said.clear()
        m = Net()
        t = trainer(local_dir)
        getattr(t, fn)(m, data, ckpt_path=INCLUSTER)
        same = all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
        result[fn] = {"step": t.strategy.incluster_restored_step, "bitwise": same, "warnings": list(seen.said)}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
