"""Run by test_distributed.py, under `accelerate launch` (2 CPU processes) and as a plain 1-process script: trains
TOPRTrainer on a stored offline dataset (so that both runs see the same completions, rewards and mu) with the given
per-device batch (and, with a sixth argument `shared`, `topr_shared_prompt_forward`), and writes per rank the logged losses (JSON) and the full, gathered parameters (torch file).
Files, not stdout: the ranks share one pipe, and their buffered writes can interleave within a line."""

import json
import os
import sys


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

import topr_trl.trainer as trainer_module  # noqa: E402
from topr_trl import TOPRConfig, TOPRTrainer  # noqa: E402
from topr_trl.offline import load_offline_dataset, stored_reward  # noqa: E402
from topr_trl.runtime.distributed import end_process_group  # noqa: E402


def main(
    model_path: str, data_dir: str, output_dir: str, results_dir: str, per_device_batch: str, forward: str = "padded"
) -> None:
    # Plain SGD without clipping: a parameter update is linear in the gradient, so a gradient scaled or averaged
    # wrongly across processes shows in the parameters (Adam's normalised step and clipping would hide a scale).
    args = TOPRConfig(
        output_dir=output_dir,
        per_device_train_batch_size=int(per_device_batch),
        num_generations=4,
        max_completion_length=6,
        max_steps=-1,
        learning_rate=0.5,
        optim="sgd",
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
        topr_shared_prompt_forward=forward == "shared",
    )
    trainer = TOPRTrainer(
        model=model_path, reward_funcs=stored_reward, args=args, train_dataset=load_offline_dataset(data_dir)
    )
    # how many times pi was scored on mu's support (data sampled with truncation): the head projected on each rank,
    # gathered under ZeRO-3
    scored = []
    scoring = trainer_module.completion_processed_log_probs
    trainer_module.completion_processed_log_probs = lambda *a, **k: scored.append(1) or scoring(*a, **k)
    # and how many forwards computed each prompt once (`topr_shared_prompt_forward`)
    shared = []
    sharing = trainer_module.chunked_shared_prompt_logps
    trainer_module.chunked_shared_prompt_logps = lambda *a, **k: shared.append(1) or sharing(*a, **k)
    trainer.train()
    parameters = dict(trainer.model.named_parameters())
    if trainer.is_deepspeed_enabled and trainer.accelerator.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(parameters.values())):
            gathered = {name: p.detach().clone() for name, p in parameters.items()}
    else:
        gathered = {name: p.detach().clone() for name, p in parameters.items()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "losses": losses,
        "steps": trainer.state.global_step,
        "support_scored": len(scored),
        "shared_prompt_forwards": len(shared),
    }
    torch.save(gathered, os.path.join(results_dir, f"parameters-rank{rank}.pt"))
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    # as the command line does: left to interpreter shutdown, a rank can abort after it has finished ("terminate
    # called without an active exception", seen under DDP on a busy CPU), which fails the launch
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:7])
