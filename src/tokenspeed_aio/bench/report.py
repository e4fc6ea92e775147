"""The benchmark's record: machine facts, the JSON document, and its markdown tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def _git(*args: str) -> str | None:
    """Read-only git queries about the checkout this package runs from (None outside one)."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Where the numbers came from: hardware, library versions, the code's commit."""
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        # Other processes compete for the CPU: on a shared machine, read numbers with this.
        "load_average_1_5_15": list(os.getloadavg()),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
    }


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def _num(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}"


def _pair(stats: dict[str, Any] | None, digits: int = 1) -> str:
    if not stats:
        return "–"
    return f"{_num(stats['p50'], digits)} / {_num(stats['p99'], digits)}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_markdown(doc: dict[str, Any]) -> str:
    """The report's tables: throughput and latency per run, control-plane time per round by
    running requests, prefix-cache hits per turn (when conversations have several)."""
    machine, target = doc["machine"], doc["target"]
    gpu = ", ".join(machine["gpus"]) or f"CPU only ({machine['cpu']}, {machine['cpu_count']} cores)"
    lines = [
        f"## {doc['workload']} — {target['kind']} `{target.get('shape') or target['model_dir']}`",
        "",
        f"{doc['timestamp']} · {gpu} · torch {machine['torch']} · transformers "
        f"{machine['transformers']} · commit {(machine['git_commit'] or '?')[:12]}"
        + (" (dirty)" if machine["git_dirty"] else ""),
        "",
    ]
    bw = doc.get("bandwidth")
    if bw:
        lines += [f"Bandwidth: {bw['bytes_per_s'] / 1e9:,.1f} GB/s ({bw['method']}).", ""]
    header = ["run", "reqs", "out tok/s", "total tok/s", "req/s", "TTFT ms p50/p99"]
    header += ["TPOT ms p50/p99", "ITL ms p50/p99", "e2e ms p50/p99", "cache hit"]
    header += ["roofline tok/s", "of roofline", "peer out tok/s", "ours / peer"]
    rows = []
    for run in doc["runs"]:
        m, roof, peer = run["metrics"], run.get("roofline") or {}, run.get("peer") or {}
        rows.append(
            [
                run["name"],
                f"{m['completed']}/{m['num_requests']}",
                _num(m["output_tokens_per_s"]),
                _num(m["total_tokens_per_s"]),
                _num(m["request_throughput"], 2),
                _pair(m["ttft_ms"]),
                _pair(m["tpot_ms"], 2),
                _pair(m["itl_ms"], 2),
                _pair(m["e2e_ms"]),
                _num(m["prefix_cache_hit_fraction"], 3),
                _num(roof.get("expected_output_tokens_per_s")),
                _num(run.get("achieved_over_roofline"), 3),
                _num(peer.get("output_tokens_per_s")) if "skipped" not in peer else "skipped",
                _num(run.get("ours_over_peer"), 2),
            ]
        )
    lines += _table(header, rows)
    cp_rows = []
    for run in doc["runs"]:
        cp = run.get("control_plane")
        for b in (cp or {}).get("decode_by_running", []):
            span = str(b["running_from"])
            if b["running_to"] > b["running_from"]:
                span += f"–{b['running_to']}"
            cp_rows.append(
                [
                    run["name"],
                    span,
                    _num(b["running_mean"]),
                    _num(b["rounds"]),
                    _num(b["cpu_ms_p50"], 3),
                    _num(b["cpu_ms_p99"], 3),
                    _num(b["wall_ms_p50"], 3),
                    _num(b["batch_tokens_mean"]),
                ]
            )
    if cp_rows:
        lines += [
            "",
            "Control-plane time per decode round, by running requests (CPU: the loop thread's;"
            " wall: CPU plus waits for the GIL):",
            "",
        ]
        header = [
            "run", "running", "mean running", "rounds",
            "CPU ms p50", "CPU ms p99", "wall ms p50", "batch tokens",
        ]  # fmt: skip
        lines += _table(header, cp_rows)
    for run in doc["runs"]:
        turns = run.get("prefix_cache_by_turn")
        if turns and len(turns) > 1:
            lines += ["", f"Prefix cache by turn ({run['name']}):", ""]
            rows = [
                [
                    str(t["turn"] + 1),
                    _num(t["requests"]),
                    _num(t["prompt_tokens"]),
                    _num(t["cached_fraction"], 3),
                    _num(t["reusable_fraction"], 3),
                ]
                for t in turns
            ]
            lines += _table(["turn", "reqs", "prompt tokens", "cached", "reusable"], rows)
    if doc.get("notes"):
        lines += ["", *[f"- {n}" for n in doc["notes"]]]
    return "\n".join(lines) + "\n"
