"""Running an export's units: the units a previous run completed are read back from the
parts file (once, here: units never read it), the others run through `run_all` (inline,
local processes, any executor or Dask), and units given up (a worker that died, or one past
``unit_timeout``) end the export with `UnitsNotDoneError` once the others are finished."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from wsi_loader.errors import UnitsNotDoneError, UnitTimeoutError, WorkerDiedError
from wsi_loader.export._folder import outputs_intact, part_records
from wsi_loader.export._unit import ExportUnit, export_unit
from wsi_loader.parallel import GivenUp, progress_bar, run_all

log = logging.getLogger(__name__)


def _completed(unit: ExportUnit, records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The record (of ``records``, the parts file) of a unit a previous run completed whose
    outputs are still intact (marked skipped), else None: a deleted or truncated shard or
    image makes the unit run again."""
    out = Path(unit.out)
    record = records.get(unit.number)
    if record is None or record.get("content") != unit.content:
        return None
    if record.get("slides", unit.slides) != unit.slides:  # (records before: not known)
        log.info("export unit %d: a slide of it changed since, writing it again", unit.number)
        return None
    if not outputs_intact(out, record, unit.verify):
        log.warning("export unit %d: outputs missing or changed, writing it again", unit.number)
        return None
    return {**record, "skipped": True}


def _unit_size(unit: ExportUnit) -> int:
    return len(unit.rows)


def run_units(
    units: list[ExportUnit], workers: int, executor: Any, progress: bool, timeout: float
) -> list[dict[str, Any]]:
    total = sum(len(u.rows) for u in units)
    with progress_bar(total, "tile", "exporting", progress and bool(units)) as bar:
        results: dict[int, dict[str, Any]] = {}
        parts = part_records(Path(units[0].out)) if units else {}
        for unit in units:  # completed units are read back here, without starting any worker
            previous = _completed(unit, parts)
            if previous is not None:
                results[unit.number] = previous
                bar.update(len(unit.rows))
        # the parts file is read here once; units never read it (it holds every manifest row)
        todo = [replace(u, rewrite=u.number in parts) for u in units if u.number not in results]
        done = run_all(
            export_unit,
            todo,
            workers,
            executor,
            bar,
            _unit_size,
            given_up=_given_up,
            timeout=timeout or None,
        )
        for unit, record in zip(todo, done, strict=True):
            results[unit.number] = record
    given_up = {r["unit"]: r["given_up"] for r in results.values() if "given_up" in r}
    if given_up:
        raise _not_done(given_up)
    return [results[number] for number in sorted(results)]


def _given_up(unit: ExportUnit, why: GivenUp) -> dict[str, Any]:
    """The record of a unit its worker did not finish (nothing of it is kept)."""
    if why.kind == "timeout":
        reason = f"was not done after {why.detail} s (unit_timeout), so its worker was ended"
    else:
        reason = f"had its worker process die under it ({why.detail})"
    return {"unit": unit.number, "given_up": reason, "kind": why.kind}


def _not_done(reasons: dict[int, str]) -> UnitsNotDoneError:
    """The error that ends an export some units of which were given up."""
    units = sorted(reasons)
    said = "; ".join(f"export unit {u} {reasons[u]}" for u in units[:5])
    more = f" (and {len(units) - 5} more units)" if len(units) > 5 else ""
    timeouts = [u for u in units if "unit_timeout" in reasons[u]]
    hint = (
        "with fewer workers if memory is short"
        if not timeouts
        else "after checking the slides' storage answers, or with a larger --unit-timeout if "
        "a unit is merely slow"
    )
    kind: type[UnitsNotDoneError] = UnitsNotDoneError  # some of each
    if not timeouts:
        kind = WorkerDiedError
    elif len(timeouts) == len(units):
        kind = UnitTimeoutError
    return kind(
        f"{said}{more}; the other units are finished: run the same export again to finish it "
        f"({hint})",
        units=units,
        reasons=reasons,
    )
