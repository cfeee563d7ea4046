"""Lightning's own ModelCheckpoint beside incluster: said once, with the fix."""

from __future__ import annotations

import logging

from integrations.conftest import require


def _said(caplog):
    return [r.getMessage() for r in caplog.records if "also saves full checkpoints" in r.getMessage()]


def test_lightnings_own_checkpointing_left_on_is_said_once(caplog, tmp_path):
    require("pytorch-lightning", "pytorch_lightning")
    import pytorch_lightning as pl

    from incluster.integrations.lightning import InclusterCheckpoint, say_other_checkpointing

    caplog.set_level(logging.WARNING, logger="incluster")
    kw = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    on = pl.Trainer(callbacks=[InclusterCheckpoint(every_n_steps=3)], **kw)  # enable_checkpointing defaults to True
    say_other_checkpointing(on)
    say_other_checkpointing(on)
    said = _said(caplog)
    assert len(said) == 1 and "ModelCheckpoint" in said[0] and "enable_checkpointing=False" in said[0], said
    caplog.clear()
    off = pl.Trainer(callbacks=[InclusterCheckpoint(every_n_steps=3)], enable_checkpointing=False, **kw)
    say_other_checkpointing(off)
    assert _said(caplog) == []
