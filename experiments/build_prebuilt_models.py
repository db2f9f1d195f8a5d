"""Build the built-in tiny models of the default settings into `topr_trl/tasks/prebuilt/`, the weights every
machine installs instead of training them (`topr_trl.tasks.tiny`, "Built-in models shipped as weights").

    OMP_NUM_THREADS=1 .venv/bin/python -m experiments.build_prebuilt_models [--force]

Run it only when the tiny model or a default warm-start setting changes; the folder's build.json records the torch
version, CPU kernels and threads that made each model. One thread, so that a rebuild on a machine like this one
gives the same weights.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from topr_trl.commands.arguments import TaskArguments
from topr_trl.tasks.arithmetic import build_warm_model, warm_model_key
from topr_trl.tasks.reasoning import WarmStartSettings, build_reasoning_warm_model
from topr_trl.tasks.tiny import PREBUILT_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="Rebuild models that are already there.")
    options = parser.parse_args()
    torch.set_num_threads(1)
    defaults = TaskArguments()
    PREBUILT_DIR.mkdir(parents=True, exist_ok=True)

    def report(step: int, steps: int, loss: float) -> None:
        print(f"  step {step}/{steps}, loss {loss:.3f}, {time.time() - started:.0f} s", flush=True)

    reasoning = WarmStartSettings(digits=3, error_rate=defaults.task_error_rate, seed=0)
    arithmetic_key = warm_model_key(defaults.task_digits, defaults.warm_start_accuracy, seed=0)
    for key in (reasoning.key(), arithmetic_key):
        target = PREBUILT_DIR / key
        if target.exists() and not options.force:
            print(f"{target} exists (--force rebuilds it)")
            continue
        shutil.rmtree(target, ignore_errors=True)
        started = time.time()
        print(f"building {key}", flush=True)
        with tempfile.TemporaryDirectory() as work:
            if key == arithmetic_key:
                built = Path(work) / key
                build_warm_model(
                    built,
                    digits=defaults.task_digits,
                    target_accuracy=defaults.warm_start_accuracy,
                    seed=0,
                    progress=report,
                )
            else:
                _, _, built = build_reasoning_warm_model(work, reasoning, progress=report)
            shutil.copytree(built, target)
        print(f"wrote {target} in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
