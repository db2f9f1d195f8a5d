"""Run by test_async_distributed.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): trains
AsyncTOPRTrainer fed by the stand-in worker (`build_async_trainer`, which runs on the main process only: TRL builds
and starts the rollout worker there, dispatches each packed micro-batch row by row to the ranks, and counts policy
versions there alone) and writes per rank what the staleness metrics saw: the staleness bin of every sample the rank
trained, its own per-bin sums and the totals after the reduction over ranks (per micro-batch), the logged
`topr/staleness_*` metrics, the losses, and a checksum of its parameters. Files, not stdout: the ranks share one pipe.

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 --mixed_precision no \
        tests/async_distributed_train.py MODEL OUTPUT_DIR RESULTS_DIR LAG MAX_STEPS [WEIGHT_SYNC_STEPS]
"""

import hashlib
import json
import os
import sys


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import topr_trl.asynchronous.trainer as async_trainer  # noqa: E402
from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer  # noqa: E402
from topr_trl.asynchronous.stand_in import WorkerSettings, build_async_trainer  # noqa: E402
from topr_trl.runtime.distributed import end_process_group  # noqa: E402
from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward  # noqa: E402


PER_DEVICE_BATCH = 4  # x 2 processes: one step is two groups of 4 completions


def record_staleness_sums(record: dict) -> None:
    """Wrap the two functions `AsyncTOPRTrainer._log_staleness_metrics` calls around its reduction: what this rank
    put in (each sample's bin, its own sums) and what it got back (the totals over ranks), per micro-batch."""
    bin_sums, bin_metrics = async_trainer.staleness_bin_sums, async_trainer.staleness_bin_metrics

    def sums(terms, signal, mask, bins, *args, **kwargs):
        result = bin_sums(terms, signal, mask, bins, *args, **kwargs)
        record["bins"].append(bins.tolist())
        record["local_sums"].append(result.tolist())
        return result

    def metrics(totals, names):
        record["totals"].append(totals.tolist())
        return bin_metrics(totals, names)

    async_trainer.staleness_bin_sums, async_trainer.staleness_bin_metrics = sums, metrics


class RecordingTrainer(AsyncTOPRTrainer):
    """Records, per micro-batch, the optimizer step it trains in and the policy version of each of this rank's
    samples, as the batch carries them to this rank (`trajectory_model_version`)."""

    record: dict

    def _log_staleness_metrics(self, terms, signal, mask, versions, *args, **kwargs) -> None:
        if versions is not None:
            self.record["micro_batch_steps"].append(self.state.global_step)
            self.record["versions"].append(versions.reshape(-1)[: mask.size(0)].tolist())
        super()._log_staleness_metrics(terms, signal, mask, versions, *args, **kwargs)


def main(model: str, output_dir: str, results_dir: str, lag: str, max_steps: str, sync_steps: str = "1") -> None:
    record = {"bins": [], "local_sums": [], "totals": [], "micro_batch_steps": [], "versions": []}
    record_staleness_sums(record)
    RecordingTrainer.record = record
    args = AsyncTOPRConfig(
        output_dir=output_dir,
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=max_completion_tokens(3),
        max_steps=int(max_steps),
        weight_sync_steps=int(sync_steps),
        learning_rate=1e-3,
        token_budget=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        heartbeat_stale_after_s=120,
        seed=0,
        topr_signal="reward",
    )  # R - 0 = +-1: every sample is in a branch, so the bins' counts are all samples
    dataset = make_reasoning_dataset(16)
    # lockstep: the worker makes one step's samples per policy version, `lag` versions old, so every trained sample
    # is at least `lag` versions stale and the run is the same whatever the two busy CPUs' timing
    trainer = build_async_trainer(
        RecordingTrainer, model, reasoning_reward, args, dataset, WorkerSettings(lag=int(lag), lockstep=True)
    )
    trainer.train()
    parameters = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    digest = hashlib.sha256()
    for name in sorted(parameters):
        digest.update(name.encode())
        digest.update(parameters[name].detach().cpu().contiguous().numpy().tobytes())
    rank = trainer.accelerator.process_index
    history = trainer.state.log_history
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "steps": trainer.state.global_step,
        "model_version": trainer.model_version,
        "worker_on_this_rank": trainer.rollout_worker is not None,
        "staleness_counts": {str(k): v for k, v in trainer.staleness_counts.items()},  # main process only
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "samples_per_step": [entry["batch/samples_per_step"] for entry in history if "batch/samples_per_step" in entry],
        "staleness_metrics": [
            {key: value for key, value in entry.items() if key.startswith("topr/staleness_")}
            for entry in history
            if "loss" in entry
        ],
        "parameters_sha256": digest.hexdigest(),
        "parameters_sum": float(sum(p.double().sum() for p in parameters.values())),
        "parameters_moved": max((parameters[n] - initial[n]).abs().max().item() for n in parameters),
        **record,
    }
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    end_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
