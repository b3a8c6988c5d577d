"""Repeated passes of a benchmark (``--repeats N`` in ``ab.py`` and ``session_replay.py``).

Terms:
* a *pass* runs every method once, each in a fresh engine or server; passes run one after the
  other, so the methods are interleaved in time (a slow minute on a shared machine hits one pass of
  every method, not every pass of one method);
* a *run* is one method's record from one pass, ``{"status": "ok", "by_concurrency": {c: ...},
  "_outputs": ...}``; a *cell* is the dict of figures of one method at one concurrency level.

Contract: ``combine_passes`` gives one record per method: the first pass's, where each timing in
``keys`` of every cell is the median over the passes and ``cell["repeats"][key]`` keeps every pass's
value (the spread; a figure a pass could not measure, ``None``, is left out of the median, and the
median of none is ``None``); everything else (tau, histograms, per-turn records) is the first pass's, and
``_outputs`` becomes the list of every pass's outputs, so that each is checked against ``none``'s. A
failed pass makes the method failed: a median must not hide it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable


def combine_passes(runs: list[dict], keys: Iterable[str],
                   cell: Callable[[dict, str], dict] = lambda run, c: run["by_concurrency"][c]) -> dict:
    """One method's record from its passes (``runs``, in pass order); ``cell(run, c)`` finds the
    figures of level ``c`` in a run."""
    failed = next((r for r in runs if r["status"] != "ok"), None)
    if failed is not None:
        return failed
    first, keys = runs[0], tuple(keys)
    if len(runs) > 1:
        for c in first["by_concurrency"]:
            cells = [cell(r, c) for r in runs]
            values = {key: [x[key] for x in cells] for key in keys}
            cells[0].update({key: _median(v) for key, v in values.items()})
            cells[0]["repeats"] = values
    first["_outputs"] = [r["_outputs"] for r in runs]
    return first


def _median(values: list) -> float | None:
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def spread(cell: dict, key: str, spec: str = ".1f") -> str:
    """``median (min-max)`` of ``key`` over the passes, the one measured value, or ``-``."""
    if cell[key] is None:
        return "-"
    runs = [v for v in cell.get("repeats", {}).get(key, []) if v is not None]
    median = format(cell[key], spec)
    return f"{median} ({min(runs):{spec}}-{max(runs):{spec}})" if runs and len(runs) > 1 else median
