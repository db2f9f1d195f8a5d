"""Launched by test_distributed.py under `accelerate launch` (2 CPU processes): trains TOPRTrainer for a few
steps and writes one JSON file per rank with a checksum of the full (gathered) parameters. Files, not stdout: the
ranks share one pipe, and their buffered writes can interleave within a line."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from topr_trl import TOPRConfig, TOPRTrainer  # noqa: E402
from topr_trl.tasks import make_arithmetic_dataset  # noqa: E402


def parity_reward(completions, **kwargs):
    return [1.0 if sum(map(ord, c[0]["content"])) % 2 == 0 else -1.0 for c in completions]


def main(model_path: str, output_dir: str, results_dir: str) -> None:
    args = TOPRConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=3, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        bf16=False, gradient_checkpointing=False, seed=0, num_iterations=2,
    )
    trainer = TOPRTrainer(model=model_path, reward_funcs=parity_reward, args=args,
                          train_dataset=make_arithmetic_dataset(16, digits=1))
    trainer.train()
    parameters = list(trainer.model_wrapped.parameters())
    if trainer.is_deepspeed_enabled and trainer.accelerator.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters):
            checksum = sum(p.double().sum().item() for p in parameters)
    else:
        checksum = sum(p.double().sum().item() for p in parameters)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rank = trainer.accelerator.process_index
    result = {"rank": rank, "world": trainer.accelerator.num_processes, "checksum": checksum, "losses": losses}
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    trainer.save_model(output_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
