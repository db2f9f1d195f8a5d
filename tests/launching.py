"""What the tests that start the package in other processes share: the environment each process runs in, the
`accelerate launch` command line for two processes on a CPU, and the flags of a short run on the built-in task."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


REPOSITORY = Path(__file__).resolve().parents[1]
# Unbuffered, each print reaches the pipe shared by both ranks in one write, so a line is never split by the other rank.
# PYTHONPATH: a script run by path has its own folder first on sys.path, not the working directory, so without it the
# ranks would import topr_trl from wherever it is installed (the editable install of another checkout) instead of
# this one
LAUNCH_ENVIRONMENT = {
    **os.environ,
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
}
LAUNCHES = {
    "ddp": ["--multi_gpu"],
    "zero2": ["--use_deepspeed", "--zero_stage", "2"],
    "zero3": ["--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "false"],
}


def accelerate_launch(*arguments: str, launch: str = "ddp", processes: int = 2) -> list[str]:
    """`accelerate launch` of `arguments` (a script and its arguments, or `-m module ...`) on `processes` CPU processes
    of one machine, by `launch` (a key of LAUNCHES), with a free port."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *LAUNCHES[launch],
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--main_process_port",
        "0",
        *arguments,
    ]


# A few seconds a step on a 2-core CPU: 4 completions of at most 8 tokens for each of 4 rows.
SMALL_RUN = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8}
# The data and reward of the folder ../shared/tools/user_folder/make_user_folder.py writes (its model: `my-model`).
USER_FOLDER_DATA = {"dataset_name": "data/prompts.jsonl", "reward_funcs": "my_rewards:correctness"}


def run_cli(argv: list[str], cwd: Path, timeout: int = 600, environment=None, **env) -> subprocess.CompletedProcess:
    """`python -m topr_trl ARGV` run to its end from the user's folder `cwd` (its modules importable), its output
    captured; in `environment` (this process's by default) with `env` on top."""
    return subprocess.run(
        [sys.executable, "-m", "topr_trl", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**(os.environ if environment is None else environment), "PYTHONPATH": str(cwd), **env},
    )


def as_flags(**options) -> list[str]:
    """Command-line flags, in order: each `name=value` as `--name value`."""
    return [item for name, value in options.items() for item in (f"--{name}", str(value))]


def builtin_run_flags(base: Path, train_prompts: int = 16, eval_prompts: int = 8, **flags) -> list[str]:
    """The flags of a short run on the built-in task: `train_prompts` and `eval_prompts` problems, no warm start, the
    built-in model kept under `base`, then `flags` (`as_flags`)."""
    return as_flags(
        task_train_prompts=train_prompts, task_eval_prompts=eval_prompts, warm_start_accuracy=0, base_model_dir=base
    ) + as_flags(**flags)


def builtin_generate_flags(base: Path) -> list[str]:
    """The flags of a short `generate` on the built-in task: 4 of 6 problems, 4 completions each by transformers, in
    shards of 2 prompts, no warm start, the built-in model kept under `base`."""
    problems = dict(task_train_prompts=6, max_prompts=4, num_generations=4, warm_start_accuracy=0, base_model_dir=base)
    return as_flags(**problems, backend="transformers", prompts_per_shard=2)


def user_data_flags(model, dataset) -> list[str]:
    """The flags naming a user's model, data file and reward (the user folder's `my_rewards:correctness`)."""
    return as_flags(model_name_or_path=model, dataset_name=dataset, reward_funcs="my_rewards:correctness")
