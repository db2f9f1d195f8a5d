"""`topr-trl` (also `python -m topr_trl`): the command line.

    topr-trl train                      # tiny local model, built-in arithmetic task, CPU, about a minute
    topr-trl train --task reasoning     # the reasoning testbed (the paper's regime), CPU, a few minutes
    topr-trl train --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prompts.jsonl \\
        --reward_funcs my_rewards:correctness   # your model, data and reward: TRL's GRPOConfig defaults + TOPR's
    topr-trl generate --num_generations 8            # an offline dataset sampled from mu, labelled
    topr-trl train --offline_dataset DIR_OR_FILE     # Algorithm 1: train on stored completions, no generation
    topr-trl iterate --iterations 2                  # generate, compose, train; mu_i = pi_{i-1}
    topr-trl evaluate --model_name_or_path outputs/topr-tiny-arithmetic --k 8   # sampled pass@1, pass@k, maj@k
    topr-trl vllm-serve --model MODEL                # a vLLM server for --use_vllm true --vllm_mode server (CPU or GPU)

With no model and no dataset a command runs the built-in task on the built-in tiny model, with settings sized for
a 2-core CPU. A model or dataset on the command line (or in `--config`) makes it a custom run, which starts from
TRL's own GRPOConfig defaults (on a machine without a GPU: `use_cpu`, no bf16). `train`, `generate` and `iterate`
take `--config file.yaml`, then any field as a flag; `--help` shows the main flags, `--help-all` every one. A run
without `--output_dir` writes below the current folder, to `outputs/topr-<model>-<data>` (train),
`outputs/topr-iterations-<model>-<data>` (iterate) or `outputs/data-<model>-<data>` (generate); evaluate writes to
`outputs/eval-<task>`. A wrong input fails in one line starting with
`topr-trl:`; `--debug` shows the traceback. All commands run under `accelerate launch`.

This module is the command line only: it parses a command's arguments once (`arguments.parse_command_line`) and
hands the dataclasses to the run (`runs.train`, `generate`, `iterate`; `evaluate.run`; `vllm-serve`'s `serve`),
which Python calls the same way.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import warnings
from pathlib import Path

from ..generation.vllm_server.command import serve
from ..runtime.distributed import end_process_group
from ..runtime.noise import TRL_DEPRECATIONS, tell_deepspeed_the_cpu
from .arguments import COMMANDS, build_parser, parse_command, parse_command_line
from .evaluate import run as run_evaluate
from .interruption import interrupted
from .output_folders import shown_path
from .runs import USER_ERRORS, generate, iterate, train


RUNS = {"train": train, "generate": generate, "iterate": iterate}
LAUNCHER_ENV = "TOPR_TRL_LAUNCHER"  # set by scripts/train.sh: the command its user typed, before the arguments


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [argument for argument in argv if argument != "--debug"]
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        build_parser()[0].print_help()
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    warnings.filterwarnings("ignore", message=TRL_DEPRECATIONS)  # the command owns its process: once, for all of it
    tell_deepspeed_the_cpu()
    try:
        run_command(argv[0], argv[1:])  # returns nothing: a console script exits 1 on a returned value
        end_process_group()
    except KeyboardInterrupt:  # Ctrl-C outside training (which says more: `interruption.interrupted_run`)
        if debug:
            raise
        raise interrupted(
            "rerun the same command to start again (a train run that saved checkpoints continues "
            "with --resume_from_checkpoint true)"
        ) from None
    except USER_ERRORS as error:
        if debug:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        message = message if message.startswith("topr-trl:") else f"topr-trl: {message}"
        raise SystemExit(f"{message} (--debug shows the traceback)") from None


def run_command(command: str, argv: list[str]):
    """`topr-trl COMMAND ARGV`: its arguments parsed once, then its run; returns what the run returns."""
    if command == "evaluate":
        return run_evaluate(*parse_command("evaluate", argv))
    if command == "vllm-serve":
        parser = build_parser()[1]["vllm-serve"]
        if "-h" in argv or "--help" in argv or "--help-all" in argv:
            parser.print_help()
            raise SystemExit(0)
        return serve(*parser.parse_args_into_dataclasses(argv, return_remaining_strings=True))
    arguments, invocation = parse_command_line(command, argv, launcher=command_line(command))
    return RUNS[command](*arguments, invocation=invocation)


def command_line(command: str) -> list[str]:
    """How the user who ran `command` runs it again, before its arguments, as they can paste it: `bash
    <repo>/scripts/train.sh` for that script's user (`LAUNCHER_ENV`), the console script by its path where
    `topr-trl` on the PATH is not it (or there is none), else `topr-trl COMMAND`."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and command == "train":
        return shlex.split(launcher)
    script = Path(sys.argv[0])
    on_path = shutil.which("topr-trl")
    if script.name == "topr-trl" and (on_path is None or Path(on_path).resolve() != script.resolve()):
        return [shown_path(str(script)), command]
    return ["topr-trl", command]


if __name__ == "__main__":
    main()
