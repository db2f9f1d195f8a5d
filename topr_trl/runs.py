"""What a command-line run does with its output folder and what it reports: an output folder holding a run is not
trained into by accident, a failed run leaves no empty folder, a resumed run finds its last checkpoint, and the
summary carries the last logged value of each headline metric."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

# The last logged value of each, for the summary of a run (p~ only under topr_signal="reward").
SUMMARY_METRICS = ("loss", "reward", "reward_std", "topr/effective_positive_proportion", "topr/positive_fraction",
                   "topr/negative_truncated_fraction", "eval_reward")


def refuse_used_output_dir(output_dir: str, overwrite: bool, resume: bool) -> None:
    """A folder that holds a finished run (its summary or its saved model) or an interrupted one (checkpoints) is not
    trained into again by accident: a finished one only with --overwrite_output_dir (or --resume_from_checkpoint to
    continue it), an interrupted one only with --resume_from_checkpoint (or --overwrite_output_dir to start again)."""
    from .distributed import last_checkpoint

    folder = Path(output_dir)
    if overwrite or resume or not folder.is_dir():
        return
    markers = [name for name in ("topr_summary.json", "model.safetensors", "adapter_model.safetensors")
               if (folder / name).exists()]
    if markers:
        raise SystemExit(f"topr-trl: {output_dir} holds a finished run ({markers[0]}); choose another --output_dir, "
                         "pass --overwrite_output_dir true to replace it or --resume_from_checkpoint true to "
                         "continue it")
    checkpoint = last_checkpoint(folder)
    if checkpoint is not None:
        raise SystemExit(f"topr-trl: {output_dir} holds an interrupted run (last checkpoint {Path(checkpoint).name}); "
                         "pass --resume_from_checkpoint true to continue it, --overwrite_output_dir true to start "
                         "again from step 0, or choose another --output_dir")


def checkpoint_to_resume(training_args) -> str | None:
    """`--resume_from_checkpoint PATH`, or `true` for the last checkpoint in output_dir (None when there is none)."""
    from .distributed import last_checkpoint

    checkpoint = training_args.resume_from_checkpoint
    if str(checkpoint).lower() == "true":
        return last_checkpoint(training_args.output_dir)
    return checkpoint


@contextlib.contextmanager
def removed_if_left_empty(output_dir: str):
    """A run that fails leaves no empty output folder behind: a folder this run created and wrote no file into is
    removed (one with any file, a checkpoint above all, is kept)."""
    from accelerate import PartialState

    folder = Path(output_dir)
    existed = folder.exists()
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir() and PartialState().is_main_process \
                and not any(path.is_file() for path in folder.rglob("*")):
            shutil.rmtree(folder, ignore_errors=True)
        raise


def last_logged(log_history: list[dict], keys) -> dict:
    """The last value logged under each of `keys` (those never logged are left out)."""
    found = {}
    for entry in log_history:
        for key in keys:
            value = entry.get(key)
            if isinstance(value, (int, float)) and value == value:  # NaN is "not measured"
                found[key] = float(value)
    return found


def shown_path(path: str) -> str:
    """`path` as the user can open it from where they ran the command: relative when it lies below the current
    folder, absolute otherwise."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)
