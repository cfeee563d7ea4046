"""The five checkpointing configurations of the goodput figure, built from measured costs.

``Costs`` holds per-GiB costs (seconds per GiB of state per rank) and a few assumptions;
its defaults are measured medians (docs/goodput.md names the source of each: 2 ranks on gloo, 1 GiB per rank, /dev/shm,
torch 2.13 CPU, the project's 2-core CI machine). A benchmark (``bench/``) can write a
JSON file with the same keys; ``Costs.from_json`` reads any subset of them.
``build`` turns costs, a state size and a failure rate into a ``model.ModelConfig``.
Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from incluster.goodput.model import ModelConfig, ModelResult, TierConfig, optimize

SYNC = "sync save to persistent storage"
ASYNC = "async save"
PINNED = "async + reused pinned staging"
WRITER = "async + writer process + cached metadata"
INCLUSTER = "+ in-cluster tiers"
CONFIGURATIONS = (SYNC, ASYNC, PINNED, WRITER, INCLUSTER)


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Costs per GiB of checkpointed state per rank, and the assumptions of the figure."""

    sync_save_s_per_gib: float = 0.74
    """Serialising a synchronous save: ``dcp.save`` blocks 0.74 s (DESIGN §1)."""
    load_s_per_gib: float = 0.66
    """Deserialising a load: ``dcp.load`` 0.66 s."""
    async_blocked_s_per_gib: float = 0.44
    """``dcp.async_save`` with defaults blocks 0.44 s (new staging buffer every call)."""
    async_durable_s_per_gib: float = 1.24
    """... and is durable on the RAM disk after 1.24 s."""
    pinned_blocked_s_per_gib: float = 0.013
    """``dcp.async_save`` with a kept ``DefaultStager`` blocks 0.013 s."""
    pinned_durable_s_per_gib: float = 1.0
    """... and is durable after 1.0 s."""
    writer_blocked_s_per_gib: float = 0.0006
    """A writer process with cached metadata blocks 0.3 ms per 512 MiB (torch_checkpointing)."""
    writer_durable_s_per_gib: float = 0.30
    """Copy into an mmap of an existing /dev/shm file (0.19 s) + xxh3 (0.11 s): the floor."""
    local_reload_s_per_gib: float = 0.30
    """Restoring from a mapped local file: copy (0.19 s) + checksum (0.11 s)."""
    peer_s_per_gib: float = 1.4
    """Moving a shard between nodes: gloo ``batch_isend_irecv``, 0.7 GB/s each way."""
    persistent_gib_per_s: float = 0.1
    """Assumed share of persistent-storage bandwidth per rank (100 GiB/s for 1,000 ranks)."""
    restart_s: float = 120.0
    """Assumed seconds from a failure to processes ready again, reload excluded."""
    serve_local: float = 0.3
    """Assumed share of failures the node survives (process crash): local tier serves."""
    serve_replica: float = 0.65
    """Assumed share that loses one node: a peer's replica serves. The rest: persistent."""
    persistent_min_interval_s: float = 0.0
    """With in-cluster tiers, upload at most this often (0: whenever the last upload is done)."""
    step_s: float = 1.0
    """Assumed training step time: the shortest interval between saves."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"cost {f.name} must be >= 0")
        if not self.persistent_gib_per_s > 0 or not self.step_s > 0:
            raise ValueError("persistent_gib_per_s and step_s must be > 0")
        if self.serve_local + self.serve_replica > 1.0:
            raise ValueError("serve_local + serve_replica must be <= 1 (the rest: persistent)")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The cost names, as in the JSON file and the CLI flags."""
        return tuple(f.name for f in fields(cls))

    def updated(self, values: dict[str, Any]) -> Costs:
        """A copy with some costs replaced; unknown names are an error."""
        unknown = sorted(set(values) - set(self.keys()))
        if unknown:
            raise ValueError(f"unknown cost(s) {unknown}; known: {', '.join(self.keys())}")
        for k, v in values.items():  # "60" or true from a JSON file is a mistake, not a number
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"cost {k} must be a number, not {v!r}")
        return replace(self, **{k: float(v) for k, v in values.items()})

    @classmethod
    def from_json(cls, path: str | Path) -> Costs:
        """Defaults updated with a JSON object of the same keys (any subset)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read costs from {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: costs must be a JSON object of name: number")
        return cls().updated(data)

    def to_dict(self) -> dict[str, float]:
        """The costs as a JSON-able dict."""
        return asdict(self)


def build(
    name: str,
    costs: Costs,
    *,
    state_gib: float,
    interruptions_per_day: float,
    gpus: int = 1,
    include_restart: bool = True,
) -> ModelConfig:
    """The model of one configuration for ``state_gib`` GiB of state per rank.

    W = state / persistent bandwidth is the upload (and download) time. Configurations
    1-4 keep checkpoints only in persistent storage; reads cost W plus deserialising.
    """
    if name not in CONFIGURATIONS:
        raise ValueError(f"unknown configuration {name!r}; use one of {CONFIGURATIONS}")
    if not state_gib > 0:
        raise ValueError("state_gib must be > 0")
    s, c = state_gib, costs
    w = s / c.persistent_gib_per_s
    restart = c.restart_s if include_restart else 0.0

    def config(delta: float, tiers: tuple[TierConfig, ...]) -> ModelConfig:
        return ModelConfig(interruptions_per_day=interruptions_per_day, gpus=gpus,
                           restart_s=restart, min_interval_s=c.step_s, blocking_s=delta,
                           tiers=tiers)

    if name == SYNC:
        delta = s * c.sync_save_s_per_gib + w
        tier = TierConfig(name="persistent", serves_fraction=1.0, time_to_recoverable_s=delta,
                          reload_s=s * c.load_s_per_gib + w)
        return config(delta, (tier,))
    if name in (ASYNC, PINNED):
        blocked, durable = (
            (c.async_blocked_s_per_gib, c.async_durable_s_per_gib)
            if name == ASYNC
            else (c.pinned_blocked_s_per_gib, c.pinned_durable_s_per_gib)
        )
        tier = TierConfig(name="persistent", serves_fraction=1.0,
                          time_to_recoverable_s=s * durable + w,
                          reload_s=s * c.load_s_per_gib + w)
        return config(s * blocked, (tier,))
    delta = s * c.writer_blocked_s_per_gib
    local = s * c.writer_durable_s_per_gib
    persistent = TierConfig(
        name="persistent",
        serves_fraction=1.0 if name == WRITER else 1.0 - c.serve_local - c.serve_replica,
        time_to_recoverable_s=local + w,
        reload_s=w + s * c.local_reload_s_per_gib,
        min_interval_s=0.0 if name == WRITER else c.persistent_min_interval_s,
    )
    if name == WRITER:
        return config(delta, (persistent,))
    tiers = (
        TierConfig(name="local", serves_fraction=c.serve_local, time_to_recoverable_s=local,
                   reload_s=s * c.local_reload_s_per_gib),
        TierConfig(name="replica", serves_fraction=c.serve_replica,
                   time_to_recoverable_s=local + s * c.peer_s_per_gib,
                   reload_s=s * (c.peer_s_per_gib + c.local_reload_s_per_gib)),
        persistent,
    )
    return config(delta, tiers)


def figure_data(
    costs: Costs,
    *,
    state_gib: float = 1.0,
    rates: tuple[float, ...] = tuple(range(1, 21)),
    include_restart: bool = False,
) -> dict[str, list[ModelResult]]:
    """Each configuration at its optimal interval, for each interruptions-per-day rate."""
    return {
        name: [
            optimize(build(name, costs, state_gib=state_gib, interruptions_per_day=r,
                           include_restart=include_restart))
            for r in rates
        ]
        for name in CONFIGURATIONS
    }


__all__ = [
    "ASYNC",
    "CONFIGURATIONS",
    "INCLUSTER",
    "PINNED",
    "SYNC",
    "WRITER",
    "Costs",
    "build",
    "figure_data",
]
