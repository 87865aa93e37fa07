"""From the processes' timings to the comparison: per case the median time of each side over the
rounds, head/base as the median of the per-round ratios (a round's two processes ran back to back,
so a ratio cancels most of the load that both saw), the spread of those ratios, and a flag on a
case slower by more than the threshold."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

SLOWER_THRESHOLD = 1.05  # head/base above this is flagged


def _quartiles(values: List[float]):
    if len(values) < 4:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summarize(names: List[str], processes: List[dict], clock: str = "wall") -> List[dict]:
    """One record per case: ``base_ms``/``head_ms`` (medians over rounds of each process's time),
    ``ratio`` (median of per-round head/base), ``ratio_min``/``ratio_max`` (and ``ratio_q1``/``ratio_q3``
    from 4 rounds on), ``ratios``, ``slower`` and, where a side never ran the case, ``na`` with why.
    ``clock``: "wall" (the processes' wall-clock times) or "cpu" (their CPU times)."""
    key = {"wall": "seconds", "cpu": "cpu_seconds"}[clock]
    rounds = sorted({p["round"] for p in processes})
    cases = []
    for name in names:
        times: Dict[str, Dict[int, float]] = {"base": {}, "head": {}}
        errors: Dict[str, Optional[str]] = {"base": None, "head": None}
        for p in processes:
            entry = p.get("cases", {}).get(name)
            if entry is None:
                errors[p["side"]] = errors[p["side"]] or p.get("error", "no result")
            elif "error" in entry:
                errors[p["side"]] = errors[p["side"]] or entry["error"]
            else:
                times[p["side"]][p["round"]] = entry[key]
        ratios = [times["head"][r] / times["base"][r] for r in rounds if r in times["head"] and r in times["base"]]
        record = {"case": name, "ratios": ratios,
                  "base_seconds": [times["base"][r] for r in sorted(times["base"])],
                  "head_seconds": [times["head"][r] for r in sorted(times["head"])]}
        for side in ("base", "head"):
            values = record[f"{side}_seconds"]
            record[f"{side}_ms"] = statistics.median(values) * 1e3 if values else None
        if ratios:
            record.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
            quartiles = _quartiles(ratios)
            if quartiles:
                record.update(ratio_q1=quartiles[0], ratio_q3=quartiles[1])
            record["slower"] = record["ratio"] > SLOWER_THRESHOLD
        else:
            why = "; ".join(f"{side}: {err}" for side, err in errors.items() if err and not times[side])
            record.update(ratio=None, slower=False, na=why or "no round with both sides")
        cases.append(record)
    return cases


def _ms(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def table(cases: List[dict]) -> List[str]:
    """The comparison as aligned text lines, then one line per n/a case saying why."""
    width = max([len("case")] + [len(c["case"]) for c in cases])
    lines = [f"{'case':<{width}}  {'base ms':>9}  {'head ms':>9}  {'head/base':>9}  {'ratio spread':>13}  flag",
             "-" * (width + 56)]
    notes = []
    for c in cases:
        if c["ratio"] is None:
            ratio, spread, flag = "n/a", "", ""
            notes.append(f"  {c['case']}: {c['na']}")
        else:
            ratio = f"{c['ratio']:.3f}"
            spread = f"{c['ratio_min']:.2f}-{c['ratio_max']:.2f}"
            flag = f"SLOWER +{(c['ratio'] - 1) * 100:.0f}%" if c["slower"] else ""
        lines.append(f"{c['case']:<{width}}  {_ms(c['base_ms']):>9}  {_ms(c['head_ms']):>9}  {ratio:>9}  "
                     f"{spread:>13}  {flag}".rstrip())
    if notes:
        lines += ["", "n/a (a side could not run the case):"] + notes
    return lines
