"""Reduced Figure-1 experiment (slow set): one seed, a small fixed dataset trained off-policy. Asserts only the
robust ordering seen in every run so far: naive REINFORCE collapses below where it started and below TOPR."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.mark.slow
def test_naive_reinforce_collapses_and_topr_does_not(tmp_path):
    import figure1

    results = figure1.main(["--seeds", "0", "--methods", "naive_reinforce", "topr", "--epochs", "3",
                            "--eval-every", "1000", "--work-dir", str(tmp_path / "work"),
                            "--output", str(tmp_path / "figure1")])
    naive = results["runs"]["naive_reinforce/seed0"]["curve"]
    topr = results["runs"]["topr/seed0"]["curve"]
    assert naive[-1]["accuracy"] < naive[0]["accuracy"] - 0.1
    assert naive[-1]["accuracy"] < topr[-1]["accuracy"]
    assert (tmp_path / "figure1.png").exists()
