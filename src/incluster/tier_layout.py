"""The persistent tier's layout, as uploads write it and restores and tools read it.

``<persistent>/<job>/step-SSSSSSSSSSSS/`` holds ``rank-RRRRR.{safetensors,json}`` for every
rank and, once every rank's shard is there, ``COMMITTED.json``: the manifest, every
rank's shard size and checksums. ``<job>/RUN.json`` names the run that uploads the
job's steps: a run replaced by a later one stops uploading. Readers trust a step only if
its manifest exists, and pass over one a restore set aside (``SET_ASIDE.json``: a copy
of it was found bad).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

from incluster.errors import TierUnavailableError

log = logging.getLogger("incluster")
MANIFEST = "COMMITTED.json"
OWNER = "RUN.json"  # <job>/RUN.json: the run that uploads the job's steps (tier_steps.TierSteps._claim)
ROLLED_BACK = "abandoned by load(step="  # how a step a rollback left is set aside (its marker's why)
SET_ASIDE = "SET_ASIDE.json"  # a restore found a copy of the step bad: passed over, never counted by retention
STEP_FOLDER = re.compile(r"^step-(\d{12,})$")


def step_dir(job: str, step: int) -> str:
    return f"{job}/step-{step:012d}"


def manifested_steps(tier: Any, job: str) -> list[int]:
    """Steps with a manifest, newest first; an unreachable tier has none (and says so)."""
    try:
        return list_manifested(tier, job)
    except TierUnavailableError as exc:
        log.warning("incluster: %s; its steps are not considered", exc)
        return []


def list_manifested(tier: Any, job: str, timeout: float | None = None) -> list[int]:
    """Steps with a manifest and not set aside (:func:`set_aside`), newest first. Raises
    TierUnavailableError when the tier cannot be listed, or (``timeout``) does not answer
    in time: a hung object store is left listing on a thread of its own."""
    return [s for s, usable in list_steps(tier, job, timeout).items() if usable]


def list_steps(tier: Any, job: str, timeout: float | None = None) -> dict[int, bool]:
    """Every manifested step, newest first, and whether it is usable (not set aside); as
    :func:`list_manifested`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            out = {}
            for name in tier.list(job):
                m = STEP_FOLDER.match(name)
                if m and MANIFEST in (names := tier.list(f"{job}/{name}")):
                    out[int(m.group(1))] = SET_ASIDE not in names
            box["steps"] = dict(sorted(out.items(), reverse=True))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    if timeout is None:
        run()
    else:
        t = threading.Thread(target=run, name="incluster-persist-list", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TierUnavailableError(f"the persistent tier {tier!r} did not answer a listing within {timeout:.0f} s")
    exc = box.get("error")
    if isinstance(exc, OSError):
        raise TierUnavailableError(f"the persistent tier {tier!r} cannot be listed ({exc})") from exc
    if exc is not None:
        raise exc
    return box["steps"]  # type: ignore[no-any-return]


def set_aside(tier: Any, job: str, step: int, why: str) -> None:
    """Mark a manifested step whose copy a restore found bad (a checksum that does not
    match, a shard missing or cut short): later restores pass over it without downloading
    it again, and retention counts only usable steps, so it never pushes a good one out.
    The shards stay until retention reaches them; ``incluster ls``/``verify`` name the
    step with why and pass over its copies, like a restore; deleting the marker has the
    step checked and tried again. Best effort: a tier that refuses the
    write is logged, the restore goes on."""
    path = f"{step_dir(job, step)}/{SET_ASIDE}"
    body = json.dumps({"step": step, "why": why, "time": time.time()}).encode()
    try:
        tier.write(path, memoryview(body))
    except OSError as exc:
        log.warning("incluster: could not mark persistent step %d as set aside (%s); later restores will try it "
                    "again", step, exc)
        return
    # A rollback's (load(step=N)) is on purpose, and said once for all its steps by the caller.
    log.log(logging.INFO if why.startswith(ROLLED_BACK) else logging.WARNING,
            "incluster: persistent step %d set aside (%s/%s written): later restores pass over it; delete "
            "that file to have it tried again", step, getattr(tier, "url", tier), path)


def set_aside_reason(tier: Any, job: str, step: int) -> str | None:
    """Why a step was set aside, or None if it was not (or the marker cannot be read)."""
    try:
        data = tier.read(f"{step_dir(job, step)}/{SET_ASIDE}")
        return str(json.loads(bytes(data)).get("why", "no reason recorded"))  # type: ignore[arg-type]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return "its marker cannot be read"
