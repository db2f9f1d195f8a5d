"""The benchmark script runs end to end (times are not asserted: they belong to the benchmark's report)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    output = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--settings", "grpo-grpo", "topr-online", "topr-offline",
         "--output", str(output)], capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads(output.read_text())
    assert set(summary["table"]) == {"grpo-grpo", "topr-online", "topr-offline"}
    assert summary["ratios"]["topr-online / grpo-grpo"]["step_time"] > 0
