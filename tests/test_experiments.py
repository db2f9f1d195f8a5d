"""Reduced runs of the evidence scripts (slow set): each runs from the repository, writes its JSON and PNG, and
reports what its docstring promises. Only orderings seen in every full run are asserted."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")  # base model and sampled data shared by the scripts


@pytest.mark.slow
def test_baseline_sweep_sets_the_effective_proportion(work_dir, tmp_path):
    import baseline_sweep

    results = baseline_sweep.main(["--seeds", "0", "--proportions", "0.5", "--targets", "0.01", "1.0", "--methods",
                                   "topr", "--epochs", "2", "--work-dir", str(work_dir),
                                   "--output", str(tmp_path / "sweep")])
    runs = results["runs"]
    nearly_all_negative, positives_only = runs["p0.5/pt0.01/topr/seed0"], runs["p0.5/pt1/topr/seed0"]
    assert nearly_all_negative["measured_p"] == pytest.approx(0.5, abs=0.01)
    assert positives_only["baseline"] == -1.0 and nearly_all_negative["baseline"] > 0.9
    assert nearly_all_negative["curve"][-1]["accuracy"] < positives_only["curve"][-1]["accuracy"]
    assert json.loads((tmp_path / "sweep.json").read_text())["summary"]["start_accuracy"] > 0
    assert (tmp_path / "sweep.png").exists()


@pytest.mark.slow
def test_figure7_untruncated_importance_weights_spike_the_gradient(work_dir, tmp_path):
    import figure7

    results = figure7.main(["--seeds", "0", "--epochs", "15", "--eval-every", "1000", "--work-dir", str(work_dir),
                            "--output", str(tmp_path / "figure7")])
    summary = results["summary"]
    assert summary["untruncated_is"]["max_grad_norm"]["mean"] > summary["topr"]["max_grad_norm"]["mean"]
    assert len(results["runs"]["topr/seed0"]["grad_norms"]) == results["runs"]["topr/seed0"]["curve"][-1]["step"]
    assert (tmp_path / "figure7.png").exists()


@pytest.mark.slow
def test_iterations_report_each_strategy(work_dir, tmp_path):
    import iterations

    # batch 8: positives only keeps ~20 % of 16 x 8 rows, fewer than the default batch of 32
    results = iterations.main(["--seeds", "0", "--iterations", "1", "--prompts", "16", "--eval-prompts", "20",
                               "--batch-size", "8", "--work-dir", str(work_dir), "--output", str(tmp_path / "iterations")])
    assert set(results["summary"]) == {"uniform", "positives_only", "anna_karenina"}
    proportions = {run["strategy"]: run["proportion_of_positives"][0] for run in results["runs"].values()}
    assert proportions["positives_only"] == 1.0 and proportions["anna_karenina"] <= proportions["uniform"] < 1
    assert (tmp_path / "iterations.png").exists()
