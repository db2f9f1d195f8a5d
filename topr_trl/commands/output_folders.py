"""A run's output folder: a folder holding a run is not trained into by accident, one that is unusable (a file, a
folder a live run holds) is refused in one line, a failed run leaves no empty folder, a resumed run finds its last
checkpoint, and two runs never write into one folder at once: the one that comes second is refused
(`output_dir_lock`). `shown_path` names a folder as the user can open it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from accelerate import PartialState

from ..runtime.distributed import last_checkpoint


LOCK_FILE = ".topr-trl.lock"
"""The file in an output folder that a run holds an exclusive lock on while it writes there; not a file of the run."""


def refuse_unusable_output_dir(output_dir: str) -> None:
    """One line, before anything else is said of the folder: an --output_dir that is a file or lies under one, and
    a folder a live run holds (`output_dir_lock`; its message first, since resuming into a live run is no way out)."""
    folder = Path(output_dir).expanduser()
    for path in (folder, *folder.parents):
        if path.exists() and not path.is_dir():
            where = "is a file" if path == folder else f"lies under {path}, which is a file"
            raise SystemExit(f"topr-trl: --output_dir {output_dir} {where}: choose a folder")
    # the main process takes the lock (`output_dir_lock`): another process of the same launch would find it held
    holder = lock_holder(folder) if PartialState().is_main_process else None
    if holder is not None:
        raise SystemExit(
            f"topr-trl: {output_dir} is in use by another run ({holder}); wait for it to finish, or "
            "choose another --output_dir"
        )


def lock_holder(folder: Path) -> str | None:
    """Who holds `folder`'s run lock (`output_dir_lock`) now, or None when no live process does."""
    try:
        handle = open(folder / LOCK_FILE)
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return " ".join(handle.read().split()) or "another process"
        except OSError:  # a file system without locks: nothing to know
            return None
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def refuse_used_output_dir(output_dir: str, overwrite: bool, resume: bool) -> None:
    """A folder that holds a finished run (its summary or its saved model) or an interrupted one (checkpoints) is not
    trained into again by accident: a finished one only with --overwrite_output_dir (or --resume_from_checkpoint to
    continue it), an interrupted one only with --resume_from_checkpoint (or --overwrite_output_dir to start again)."""
    folder = Path(output_dir)
    if overwrite or resume or not folder.is_dir():
        return
    markers = [
        name
        for name in ("topr_summary.json", "model.safetensors", "adapter_model.safetensors")
        if (folder / name).exists()
    ]
    if markers:
        raise SystemExit(
            f"topr-trl: {output_dir} holds a finished run ({markers[0]}); choose another --output_dir, or pass "
            "--overwrite_output_dir true to replace it"
            + (
                " (or --resume_from_checkpoint true with a larger --max_steps to train it further)"
                if last_checkpoint(folder)
                else ""
            )
        )
    checkpoint = last_checkpoint(folder)
    if checkpoint is not None:
        raise SystemExit(
            f"topr-trl: {output_dir} holds an interrupted run (last checkpoint {Path(checkpoint).name}); "
            "pass --resume_from_checkpoint true to continue it, --overwrite_output_dir true to start "
            "again from step 0, or choose another --output_dir"
        )


def refuse_unresumable(training_args) -> None:
    """`--resume_from_checkpoint` that would not continue a run is refused in one line instead of doing something else
    without a word: no checkpoint to continue from (a new run would start at step 0, and overwrite a finished one), or
    a checkpoint that already reached the steps asked for (the trainer would step past them and overwrite the finished
    model)."""
    if not training_args.resume_from_checkpoint:
        return
    checkpoint = checkpoint_to_resume(training_args)
    output_dir = training_args.output_dir
    if checkpoint is None or not Path(checkpoint).is_dir():
        where = f"{checkpoint} is not a checkpoint folder" if checkpoint else f"{output_dir} holds no checkpoint"
        raise SystemExit(
            f"topr-trl: --resume_from_checkpoint: {where} to continue from; drop the flag to start a new run "
            "(with --overwrite_output_dir true over a finished one)"
        )
    state_file = Path(checkpoint) / "trainer_state.json"
    if not state_file.is_file():
        return  # transformers says what is missing when it loads the checkpoint
    state = json.loads(state_file.read_text())
    step, target = state.get("global_step", 0), training_args.max_steps
    if target <= 0:  # an epoch budget: the run is done when the checkpoint reached its own step count for it
        done = step >= state.get("max_steps", float("inf")) and training_args.num_train_epochs <= state.get(
            "num_train_epochs", 0
        )
        asked = f"--num_train_epochs {training_args.num_train_epochs:g}"
    else:
        done, asked = step >= target, f"--max_steps {target}"
    if done:
        raise SystemExit(
            f"topr-trl: {Path(checkpoint).name} already reached step {step}, so {asked} leaves nothing to train; "
            "raise it to train further, or pass --overwrite_output_dir true (without --resume_from_checkpoint) to "
            "start again from step 0"
        )


def checkpoint_to_resume(training_args) -> str | None:
    """`--resume_from_checkpoint PATH`, or `true` for the last checkpoint in output_dir (None when there is none)."""
    checkpoint = training_args.resume_from_checkpoint
    if str(checkpoint).lower() == "true":
        return last_checkpoint(training_args.output_dir)
    return checkpoint


@contextlib.contextmanager
def removed_if_left_empty(output_dir: str, logged_nothing=lambda: True):
    """A run that fails leaves no empty output folder behind: a folder this run created and wrote no file of its own
    into is removed (one with any such file, a checkpoint above all, is kept). The run's lock and, while
    `logged_nothing()` (no step was logged), the tracker's files under `runs/` (TensorBoard writes the arguments there
    when training starts) are not files of its own; once a step is logged they are its record and are kept."""
    folder = Path(output_dir)
    existed = folder.exists()

    def bookkeeping(path: Path) -> bool:
        return path.name == LOCK_FILE or (path.relative_to(folder).parts[0] == "runs" and logged_nothing())

    try:
        yield
    except BaseException:
        if (
            not existed
            and folder.is_dir()
            and PartialState().is_main_process
            and not any(path.is_file() and not bookkeeping(path) for path in folder.rglob("*"))
        ):
            shutil.rmtree(folder, ignore_errors=True)
        raise


@contextlib.contextmanager
def output_dir_lock(output_dir: str):
    """Hold `output_dir` for this run: a second run into the same folder while this one is alive is refused in one
    line naming this one, instead of both writing checkpoints into it. The lock is the kernel's (`flock` on
    `LOCK_FILE`): the operating system releases it when the process ends however it ends (a crash, SIGKILL, a
    reboot), so a dead run never leaves the folder locked; the file's text only says who holds it. Under
    `accelerate launch` the main process holds it for the run (the others would otherwise refuse their own run)."""
    if not PartialState().is_main_process:
        yield
        return
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+")  # not "w": truncating would erase the holder's text before we know
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if not isinstance(error, BlockingIOError):  # a file system without locks (some network mounts): run unlocked
            handle.close()
            print(
                f"[topr-trl] {output_dir} cannot be locked ({error.strerror}): a second run into it "  # noqa: T201
                "would not be refused",
                flush=True,
            )
            yield
            return
        handle.seek(0)
        holder = " ".join(handle.read().split()) or "another process"
        handle.close()
        raise SystemExit(
            f"topr-trl: {output_dir} is in use by another run ({holder}); wait for it to finish, or "
            "choose another --output_dir"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def shown_path(path: str) -> str:
    """`path` as the user can open it from where they ran the command: relative when it lies below the current
    folder, absolute otherwise."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)
