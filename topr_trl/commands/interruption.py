"""Ctrl-C in a run: training stops at the end of the current optimizer step (`InterruptAtStepEnd`), and the run ends
in one line saying what was kept and how to go on (`interrupted`): for a training run, its last checkpoint and the
command that resumes it (`interrupted_run`). Called from Python, a run names the argument that resumes it instead."""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers import TrainerCallback

from ..offline.generation import GeneratedWithOtherSettings
from ..runtime.distributed import last_checkpoint
from .arguments import Invocation
from .output_folders import shown_path


class InterruptAtStepEnd(TrainerCallback):
    """Ctrl-C during training stops the run at the end of the current optimizer step, as a KeyboardInterrupt raised
    there. Python raises KeyboardInterrupt wherever the main thread happens to be, and where that is a finaliser (a
    `__del__`, a weakref callback: TensorBoard's writer, a released tensor) the exception is printed as "ignored" and
    lost, and the run goes on to its last step. Here the signal only sets a flag, read at the step's end; a second
    Ctrl-C interrupts at once (Python's own handler is back after the first). Use as a context manager around
    `trainer.train()`, with the callback added to the trainer."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _request(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self):
        # a process started with SIGINT ignored (a background job of a script) keeps ignoring it
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._request)
        return self

    def __exit__(self, *exc):
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._request:
            signal.signal(signal.SIGINT, self._previous)
        return False

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested:
            raise KeyboardInterrupt
        return control


def interrupted(what: str) -> SystemExit:
    """Ctrl-C's one line, `topr-trl: interrupted; <what>` (what was kept and how to go on), and exit status 130 as a
    shell gives an interrupted program. It starts on a line of its own: the progress bar it interrupts has none."""
    print(f"\ntopr-trl: interrupted; {what}", file=sys.stderr, flush=True)  # noqa: T201 - the command's own output
    return SystemExit(130)


@contextlib.contextmanager
def generation_ended_in_one_line(kept: str, ways_out: Callable[[Path], str]) -> Iterator[None]:
    """Around a command's generation: Ctrl-C ends it in `interrupted`'s line saying what was `kept`, and a folder
    holding a generation made with other settings is refused naming the command line's flags, then `ways_out(the
    folder)`."""
    try:
        yield
    except KeyboardInterrupt:
        raise interrupted(kept) from None
    except GeneratedWithOtherSettings as refusal:
        raise GeneratedWithOtherSettings(
            refusal.output_dir, refusal.changes, command_line=True, ways_out=ways_out(refusal.output_dir)
        ) from None


def rerun(command: str, invocation: Invocation | None) -> str:
    """How the user runs `command` again as they ran it: the same command line, or the same Python call."""
    return "rerun the same command" if invocation is not None else f"call {command} again with the same arguments"


def interrupted_run(output_dir: str, invocation: Invocation | None) -> SystemExit:
    """`interrupted` for a training run: where the last checkpoint is and how to resume it (the command the user ran,
    with `--resume_from_checkpoint true`; from Python, the argument to set), or that none was saved."""
    checkpoint = last_checkpoint(output_dir)
    if checkpoint is None:
        save_steps = "--save_steps" if invocation is not None else "training_args.save_steps"
        return interrupted(
            f"no checkpoint was saved yet in {shown_path(output_dir)} (see {save_steps}), so "
            + (
                "a rerun of the same command starts again"
                if invocation is not None
                else "calling train again starts again"
            )
        )
    if invocation is None:
        return interrupted(
            f"the last checkpoint is {shown_path(checkpoint)}; resume by calling train again with "
            "training_args.resume_from_checkpoint=True"
        )
    return interrupted(
        f"the last checkpoint is {shown_path(checkpoint)}; resume with: {shlex.join(resume_command(invocation))}"
    )


def resume_command(invocation: Invocation) -> list[str]:
    """The command the user ran, with `--resume_from_checkpoint true` in place of any they gave."""
    kept, skip_value = [], False
    for argument in invocation.arguments:  # the earlier --resume_from_checkpoint (and its value) gives way to `true`
        if skip_value and not argument.startswith("-"):
            skip_value = False
            continue
        skip_value = argument == "--resume_from_checkpoint"
        if not skip_value and not argument.startswith("--resume_from_checkpoint="):
            kept.append(argument)
    return [*invocation.launcher, *kept, "--resume_from_checkpoint", "true"]
