"""benchmarks/checkpoint.py --quick: every method measured, in one run, with finite figures."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tests.conftest import REPO, run_command

SCRIPT = REPO / "benchmarks" / "checkpoint.py"
METHODS = ("phalanx", "phalanx-async", "rank0-old", "torch-save", "dcp")


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def test_quick_run_measures_every_method(workdir: Path) -> None:
    report = workdir / "checkpoint.json"
    done = run_command([sys.executable, str(SCRIPT), "--quick", "--dir", str(workdir), "--json", str(report)],
                       timeout=90, cwd=workdir)  # fmt: skip
    assert done.returncode == 0, done.output
    results = json.loads(report.read_text())
    assert list(results["sizes"]) == ["10M"] and results["skipped_sizes"] == {}, results["skipped_sizes"]
    size = results["sizes"]["10M"]
    assert size["rounds"] == 2 and list(size["methods"]) == list(METHODS)
    for method, row in size["methods"].items():
        assert row["skipped"] == {}, (method, row["skipped"])
        assert len(row["runs"]) == 2, method
        figures = ["save_stall_s", "save_wall_s"] + (["load_s"] if method != "phalanx-async" else [])
        for figure in figures:
            assert finite(row[figure]) and row[figure] > 0, (method, figure, row[figure])
        assert row["save_stall_s"] <= row["save_wall_s"] + 1e-9, method
        peaks = row["save_peak_extra_bytes"] + (row["load_peak_extra_bytes"] if method != "phalanx-async" else [])
        assert len(peaks) >= 2 and all(finite(p) for p in peaks), (method, peaks)
    # the async copy holds the whole share: its peak is at least the state
    assert min(size["methods"]["phalanx-async"]["save_peak_extra_bytes"]) >= size["state_bytes_per_rank"] * 0.9
    verdicts = {target["target"]: target["verdict"] for target in size["targets"]}
    assert len(verdicts) == 6 and set(verdicts.values()) <= {"met", "not met"}, verdicts
    for line in ("phalanx load / dcp load", "stall/torch.save", "target phalanx-async stall / torch-save save"):
        assert line in done.stdout, done.stdout
    assert not list(workdir.glob("phalanx-ckpt-bench-*")), "the checkpoints were not removed"
