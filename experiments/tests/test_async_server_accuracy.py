"""experiments/async_server_accuracy.py reduced, on a real vLLM engine (its CPU build: `bash experiments/test.sh
--vllm`)."""

import os

import pytest


pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="run on a real vLLM engine: `bash experiments/test.sh --vllm`")
DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_the_real_pipeline_accuracy_script_trains_every_method_on_one_server_and_measures_the_lag(
    evidence_work_dir, tmp_path, monkeypatch
):
    """experiments/async_server_accuracy.py reduced: synchronous TOPRTrainer in server mode and TRL's own
    AsyncGRPOTrainer (made CPU-capable, on this package's gloo weight path) against one `topr-trl vllm-serve`, one
    after the other from the same warm model. Every run trains its steps and drops nothing; the lag is counted in
    optimizer updates (pushes every W = 4 steps put batches 1 to 4 updates behind, TRL's staleness counts pushes)."""
    from experiments import async_server_accuracy

    for name in DISTRIBUTED_VARIABLES:  # the script's server inherits this process's environment
        monkeypatch.delenv(name, raising=False)
    cores = os.sched_getaffinity(0)
    reduced = [
        "--seeds",
        "0",
        "--steps",
        "6",
        "--batch_size",
        "16",
        "--eval_prompts",
        "32",
        "--eval_samples",
        "2",
        "--checkpoints",
        "2",
        "--methods",
        "sync_topr",
        "async_grpo_keep",
        "--sync_every",
        "4",
    ]
    results = async_server_accuracy.main(
        [*reduced, "--work_dir", str(evidence_work_dir), "--output", str(tmp_path / "acc")]
    )
    assert os.sched_getaffinity(0) == cores  # the trainer's pinning is undone
    runs = results["runs"]
    assert set(runs) == {"sync_topr/sync/seed0", "async_grpo_keep/w4/seed0"}
    assert all(run["steps"] == 6 and run["dropped"] == 0 for run in runs.values())
    synchronous, asynchronous = runs["sync_topr/sync/seed0"], runs["async_grpo_keep/w4/seed0"]
    assert synchronous["lag_mean"] == 0
    # steps 1-6 with pushes after step 4: lags 0, 1, 2, 3, 4, 1 when every sample is of the newest push
    assert asynchronous["lag_mean"] >= 11 / 6 and asynchronous["staleness_mean"] < 1
    assert "async_grpo_keep/w4-sync_topr" in results["summary"]["paired"]
    assert (tmp_path / "acc.json").exists() and (tmp_path / "acc.png").exists()
