"""The asynchronous experiments' scripts, reduced (slow set): experiments/async_throughput.py and
experiments/async_staleness.py."""

import importlib

import pytest


def _script(name):
    return importlib.import_module(f"experiments.{name}")


@pytest.mark.slow
def test_async_throughput_smoke_trains_equal_steps_in_both_modes(tmp_path):
    results = _script("async_throughput").main(["--smoke", "--output", str(tmp_path / "throughput.json")])
    (pair,) = results["pairs"]
    assert pair["synchronous"]["trained_samples"] == pair["asynchronous"]["trained_samples"] == 4 * 16
    assert pair["synchronous"]["staleness_mean"] == 0  # lockstep: every sample read at the version that made it
    assert results["ratio_median"] == pair["ratio"] > 0


@pytest.mark.slow
def test_async_staleness_smoke_drops_nothing_with_topr_and_stalls_trls_trainer_beyond_its_cap(
    evidence_work_dir, tmp_path
):
    results = _script("async_staleness").main(
        ["--smoke", "--work_dir", str(evidence_work_dir), "--output", str(tmp_path / "staleness")]
    )
    runs = results["runs"]
    assert runs["async_topr/k8/seed0"]["dropped"] == 0 and runs["async_topr/k8/seed0"]["steps"] == 6
    assert runs["async_topr/k8/seed0"]["stalled"] is None
    # lag 8 > TRL's max_staleness 4: once 5 versions exist every sample is dropped and the run stops early
    dropping = runs["async_grpo_drop/k8/seed0"]
    assert dropping["dropped"] > 0 and dropping["stalled"] is not None and dropping["steps"] < 6
    assert (tmp_path / "staleness.png").exists()
