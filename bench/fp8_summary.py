"""The FP8 acceptance table from ``bench/fp8_acceptance.sh``'s raw JSON files.

    python bench/fp8_summary.py OUTDIR

Per engine run: batch-1 TPOT (c=1, mean), output tok/s at c=64 and at the largest level,
each against its roofline (``achieved_over_roofline``: the run's output rate over the
decode-only roofline's; for c=1, the roofline's step time over the TPOT) and the issue's
target. Writes OUTDIR/fp8-summary.json beside the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {  # (file stem, level) -> (metric, target, better)
    ("fixed-1k-llama-8b-fp8-kvfp8", "c=1"): ("tpot_ms", 2.3, "lower"),
    ("fixed-1k-llama-8b-fp8-kvfp8", "c=64"): ("out_tok_s", 11000, "higher"),
    ("fixed-1k-llama-8b-fp8-kvfp8", "max"): ("out_tok_s", 18000, "higher"),
}


def rows(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    runs = doc["runs"]
    out = []
    largest = max(runs, key=lambda r: r["params"].get("concurrency", 0))["name"]
    for run in runs:
        m, roof = run["metrics"], run.get("roofline") or {}
        level = (
            "max" if run["name"] == largest and run["name"] not in ("c=1", "c=64") else run["name"]
        )
        tpot = m["tpot_ms"]["mean"]
        row = {
            "file": path.stem, "level": run["name"], "failed": m["failed"],
            "tpot_ms": tpot, "out_tok_s": m["output_tokens_per_s"],
            "roofline_step_ms": roof.get("step_floor_ms_mean"),
            "roofline_out_tok_s": roof.get("expected_output_tokens_per_s"),
            "of_roofline": run.get("achieved_over_roofline"),
        }  # fmt: skip
        if run["name"] == "c=1" and tpot and roof:
            row["of_roofline"] = roof["step_floor_ms_mean"] / tpot
        target = TARGETS.get((path.stem, level)) or TARGETS.get((path.stem, run["name"]))
        if target:
            metric, value, better = target
            got = row[metric]
            row["target"] = f"{metric} {'<=' if better == 'lower' else '>='} {value}"
            row["meets"] = got is not None and (got <= value if better == "lower" else got >= value)
        out.append(row)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    table = []
    for path in sorted(out.glob("fixed-1k-*.json")):
        try:
            table += rows(path)
        except (KeyError, ValueError) as err:
            print(f"{path.name}: unreadable ({err})")
    print("| run | level | TPOT ms | out tok/s | roofline out tok/s | of roofline | target | met |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
        print(
            f"| {r['file'].removeprefix('fixed-1k-')} | {r['level']} | {fmt(r['tpot_ms'], '.2f')} "
            f"| {fmt(r['out_tok_s'], ',.0f')} | {fmt(r['roofline_out_tok_s'], ',.0f')} "
            f"| {fmt(r['of_roofline'], '.2f')} | {r.get('target', '')} | {r.get('meets', '')} |"
        )
    (out / "fp8-summary.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
