"""The GPU suite's end (``benchmarks/gpu_suite.sh``): one JSON of every part and a table.

    python benchmarks/gpu_suite_report.py OUT_DIR

Reads ``OUT_DIR/summary.tsv`` (part, status, seconds: what the suite wrote) and, from each part's
log ``OUT_DIR/<part>.log``, the last line that is a JSON object (what the part's benchmark printed
with ``--json``). Writes ``OUT_DIR/suite.json`` and prints one row per part: its status, its time
and its headline figures; the training parts (``train_throughput.py`` rows) give tokens/s per
device, MFU and peak memory. Then the targets of the layout planner's issue: the 3B shape's bf16
MFU (at least 55% on one H100) and float8's speed over bf16 (at least 1.25x).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MFU_TARGET, FLOAT8_TARGET = 55.0, 1.25


def read_suite(out: Path) -> dict:
    parts = {}
    for line in (out / "summary.tsv").read_text().splitlines():
        name, status, seconds = line.split("\t")
        log = out / f"{name}.log"
        ran = not status.startswith("skipped") and log.exists()
        parts[name] = {
            "status": status,
            "seconds": int(seconds),
            "result": last_json(log.read_text(errors="replace")) if ran else None,
        }
    return parts


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def headline(result: dict | None) -> str:
    """A part's figures in one line: a training run's speed, else the ceilings, else the JSON's
    top-level numbers (the whole result is in suite.json)."""
    if not result:
        return ""
    rows = result.get("rows")
    if isinstance(rows, list) and rows and "setting" in rows[0]:  # a train_throughput.py run
        r = rows[0]
        if "error" in r:
            return f"error: {str(r['error'])[-120:]}"
        return (
            f"{_num(r.get('tokens_per_s_per_device'), ',.0f')} tokens/s, "
            f"MFU {_num(r.get('mfu_pct'), '.1f')}%, "
            f"peak {_num(r.get('peak_memory_gib'), '.1f')} GiB, "
            f"step {_num(r.get('step_time_s'), '.3f')} s"
        )
    if "matmul" in result and "copy" in result:
        return (
            f"matmul {result['matmul']['tflops']:.1f} TFLOP/s, "
            f"copy {result['copy']['gb_per_s']:.0f} GB/s"
        )
    scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str))}
    extra = f" (+ {len(rows)} rows)" if isinstance(rows, list) else ""
    return (", ".join(f"{k} {v}" for k, v in scalars.items()) + extra)[:160]


def _num(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _run(parts: dict, name: str) -> dict | None:
    """A training part's row, if it ran to the end and logged its speed."""
    part = parts.get(name) or {}
    rows = (part.get("result") or {}).get("rows") or [{}]
    ok = part.get("status") == "ok" and "error" not in rows[0]
    return rows[0] if ok and rows[0].get("tokens_per_s_per_device") else None


def targets(parts: dict) -> list[str]:
    """The issue's two targets, where their parts ran."""
    lines = []
    bf16, float8 = _run(parts, "3b_bf16"), _run(parts, "3b_float8")
    if bf16 and bf16.get("mfu_pct") is not None:
        ok = "met" if bf16["mfu_pct"] >= MFU_TARGET else "not met"
        lines.append(f"3B bf16 MFU {bf16['mfu_pct']:.1f}% (target {MFU_TARGET:.0f}%: {ok})")
    if bf16 and float8:
        ratio = float8["tokens_per_s_per_device"] / bf16["tokens_per_s_per_device"]
        ok = "met" if ratio >= FLOAT8_TARGET else "not met"
        lines.append(f"3B float8 / bf16 {ratio:.2f}x (target {FLOAT8_TARGET}x: {ok})")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_suite_report.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if not (out / "summary.tsv").exists():
        print(f"error: {out / 'summary.tsv'} does not exist (run benchmarks/gpu_suite.sh)")
        return 2
    parts = read_suite(out)
    env = (parts.get("env") or {}).get("result") or {}
    report = {"env": env, "parts": parts, "targets": targets(parts)}
    (out / "suite.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"GPU suite: {env.get('device', '?')}, torch {env.get('torch', '?')} ({out}/suite.json)")
    print(f"{'part':14} {'status':34} {'s':>4}  result")
    for name, p in parts.items():
        print(f"{name:14} {p['status']:34} {p['seconds']:4d}  {headline(p['result'])}")
    for line in report["targets"]:
        print(line)
    # exit 1 when a part failed or ran out of time (one skipped for the budget is not a failure)
    failed = [n for n, p in parts.items() if p["status"] != "ok" and "skipped" not in p["status"]]
    return 1 if failed or not parts else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
