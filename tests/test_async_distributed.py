"""Asynchronous TOPR on two CPU processes (`accelerate launch --multi_gpu --num_processes 2`, gloo).

TRL 1.16's `AsyncGRPOTrainer` runs data parallel as one rollout worker for all processes: the main process alone
builds and starts the worker, reads its queue, packs each micro-batch into one row per process and dispatches the rows
(accelerate's `DataLoaderDispatcher`); it alone talks to the server and counts policy versions (`model_version` stays
0 elsewhere); every process joins each weight sync's barriers and DDP's gradient all-reduce. So the staleness a process
measures on its row needs the main process's version (`AsyncTOPRTrainer._log_staleness_metrics` broadcasts it) and the
histogram of pi/mu by staleness needs the sum of every process's rows (one reduction). These tests hold both, on the
stand-in worker, and hold the constructor to taking the same branches on every process against a gloo server."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.launching import LAUNCH_ENVIRONMENT, accelerate_launch, builtin_run_flags
from tests.test_async import MODEL


TRAIN_SCRIPT = Path(__file__).with_name("async_distributed_train.py")
SERVER_SCRIPT = Path(__file__).with_name("async_distributed_server.py")
STEPS = 4
SAMPLES_PER_STEP = 8  # 2 processes x 4
# The staleness each step trains at, in lockstep (one step's samples per policy version, `lag` versions old). The
# policy is version 1 after the sync at train begin and one more after each step; TRL's dataloader reads the next
# micro-batch before the step's sync, so from the second step on the samples read at version v train at v + 1, as on
# one process: with lag 0 the first step trains at staleness 0 and the others at 1.
EXPECTED_STALENESS = {0: [0, 1, 1, 1], 2: [0, 1, 2, 3]}


def launch(arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`accelerate launch` in a session of its own, so that a run that hangs is ended with every process it started
    (a rank waiting in a collective outlives its launcher otherwise)."""
    process = subprocess.Popen(
        accelerate_launch(*arguments),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=LAUNCH_ENVIRONMENT,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"the two processes did not finish in {timeout:.0f} s (a collective one of them never joined?): "
            f"{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def rank_results(folder: Path) -> tuple[dict, dict]:
    results = {json.loads(path.read_text())["rank"]: json.loads(path.read_text()) for path in folder.glob("rank*.json")}
    assert sorted(results) == [0, 1] and all(result["world"] == 2 for result in results.values())
    return results[0], results[1]


@pytest.mark.slow
@pytest.mark.parametrize("lag", sorted(EXPECTED_STALENESS))
def test_two_processes_train_on_the_main_processs_staleness_and_sum_their_bins(lag, tmp_path):
    """Four steps of 2 x 4 samples with the stand-in worker `lag` versions behind. Each process bins every sample of
    its row at the main process's version minus the sample's own (without the broadcast, the second process's version
    0 puts them in the negative bin); the totals both processes log are the sum of both rows' sums (without the
    reduction each logs its own), so both log the same ratios by staleness and the bins' counts add up to every
    trained sample; and DDP leaves the same parameters on both."""
    import torch

    from topr_trl.asynchronous.trainer import STALENESS_BIN_NAMES, staleness_bin_index
    from topr_trl.training.policy_metrics import STALENESS_BIN_SUMS, staleness_bin_metrics

    completed = launch(
        [str(TRAIN_SCRIPT), MODEL, str(tmp_path / "out"), str(tmp_path), str(lag), str(STEPS)], timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    main, other = rank_results(tmp_path)

    # one worker, one version count: the main process's
    assert main["worker_on_this_rank"] and not other["worker_on_this_rank"]
    assert main["model_version"] == STEPS + 1 and other["model_version"] == 0
    # data parallel: the same losses (reduced over processes) and the same parameters, moved by training
    assert main["steps"] == other["steps"] == STEPS
    assert main["losses"] == other["losses"] and len(main["losses"]) == STEPS
    assert main["parameters_sha256"] == other["parameters_sha256"] and main["parameters_moved"] > 1e-4
    assert main["samples_per_step"] == other["samples_per_step"] == [SAMPLES_PER_STEP] * STEPS

    for result in (main, other):  # each process's own row: its samples' versions, as the batch carried them
        assert result["micro_batch_steps"] == list(range(STEPS))
        staleness = [
            [step + 1 - version for version in versions]
            for step, versions in zip(result["micro_batch_steps"], result["versions"], strict=True)
        ]
        assert staleness == [[expected] * (SAMPLES_PER_STEP // 2) for expected in EXPECTED_STALENESS[lag]]
        assert result["bins"] == [[staleness_bin_index(s) for s in row] for row in staleness]
    if lag == 0:  # TRL's read-time staleness (main process): every sample read at the version that generated it
        assert set(main["staleness_counts"]) == {"0"}

    # the reduction: both processes hold the sum of both rows' sums, and log what it gives
    totals = torch.tensor(main["totals"])
    assert torch.equal(totals, torch.tensor(other["totals"]))
    torch.testing.assert_close(
        totals, torch.tensor(main["local_sums"]) + torch.tensor(other["local_sums"]), rtol=1e-6, atol=1e-6
    )
    counts = (
        totals[..., STALENESS_BIN_SUMS.index("count_positive")]
        + totals[..., STALENESS_BIN_SUMS.index("count_negative")]
    )  # every sample: the signal R - 0 is +-1
    trained = Counter(index for result in (main, other) for row in result["bins"] for index in row)
    assert counts.sum(0).tolist() == [float(trained[index]) for index in range(len(STALENESS_BIN_NAMES))]
    assert counts.sum().item() == STEPS * SAMPLES_PER_STEP
    assert main["staleness_metrics"] == other["staleness_metrics"]
    for logged, step_totals in zip(main["staleness_metrics"], totals, strict=True):  # one micro-batch per step
        expected = {
            key: None if math.isnan(value) else value
            for key, value in staleness_bin_metrics(step_totals, STALENESS_BIN_NAMES).items()
        }
        assert logged.keys() == expected.keys()
        assert logged == pytest.approx(expected, rel=1e-6, abs=1e-9)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_processes_against_one_gloo_server_take_the_same_branches_of_trls_constructor(tmp_path):
    """A PEFT model against a server running the gloo weight path, on two processes: the main process asks the server
    and holds the transfer, the other is told (`gloo_weight_transfer`), so neither probes the server for adapter-only
    sync. Before, the other process got None and entered TRL's probe (a `broadcast_object_list` the main process never
    joins, async_grpo_trainer.py:1330 in TRL 1.16.0) and the launch hung."""
    completed = launch([str(SERVER_SCRIPT), MODEL, str(tmp_path), str(free_port())], timeout=150)
    assert completed.returncode == 0, completed.stderr[-4000:]
    main, other = rank_results(tmp_path)
    assert main["weight_transfer"] == "GlooWeightTransfer" and other["weight_transfer"] == "NoneType"
    assert main["rollout_worker"] == "RolloutWorker" and other["rollout_worker"] == "NoneType"
    assert main["lora_sync"] is other["lora_sync"] is False  # the merged weights are synced, by the main process


@pytest.mark.slow
def test_train_command_runs_asynchronous_topr_on_two_processes(tmp_path):
    """`accelerate launch ... -m topr_trl train --asynchronous` on 2 CPU processes: the stand-in worker generates on
    the main process for both, the run trains its steps, and the summary counts the samples read once."""
    output = tmp_path / "run"
    completed = launch(
        [
            "-m",
            "topr_trl",
            "train",
            "--asynchronous",
            "--async_lag",
            "1",
            *builtin_run_flags(
                tmp_path / "base", max_steps=3, output_dir=output, per_device_train_batch_size=4, num_generations=4
            ),
        ],
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.count("samples read, staleness mean") == 1  # printed by the main process only
    summary = json.loads((output / "topr_summary.json").read_text())
    assert summary["steps"] == 3 and summary["asynchronous"]["dropped"] == 0
    counts = {int(k): v for k, v in summary["asynchronous"]["staleness_counts"].items()}
    assert sum(counts.values()) >= 3 * SAMPLES_PER_STEP and max(counts) >= 1  # the lag of 1 shows up
