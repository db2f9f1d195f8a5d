"""What a command-line run does with its output folder and what it reports: an output folder holding a run is not
trained into by accident, a failed run leaves no empty folder, a resumed run finds its last checkpoint, and the
summary carries the last logged value of each headline metric. Two runs never write into one folder at once: the
one that comes second is refused (`output_dir_lock`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from accelerate import PartialState
from huggingface_hub import get_token
from transformers import TrainerCallback
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

from ..distributed import gpu_available, last_checkpoint
from ..sources import hub_unreachable_reason
from ..vllm_server import BACKEND
from ..vllm_server.client import server_url, server_weight_backend


LOCK_FILE = ".topr-trl.lock"
"""The file in an output folder that a run holds an exclusive lock on while it writes there; not a file of the run."""

# The last logged value of each, for the summary of a run (p~ only under topr_signal="reward").
SUMMARY_METRICS = ("loss", "reward", "reward_std", "topr/effective_positive_proportion", "topr/positive_fraction",
                   "topr/negative_truncated_fraction", "eval_reward")


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
        raise SystemExit(f"topr-trl: {output_dir} is in use by another run ({holder}); wait for it to finish, or "
                         "choose another --output_dir")


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
        if not existed and folder.is_dir() and PartialState().is_main_process \
                and not any(path.is_file() and not bookkeeping(path) for path in folder.rglob("*")):
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
            print(f"[topr-trl] {output_dir} cannot be locked ({error.strerror}): a second run into it "  # noqa: T201
                  "would not be refused", flush=True)
            yield
            return
        handle.seek(0)
        holder = " ".join(handle.read().split()) or "another process"
        handle.close()
        raise SystemExit(f"topr-trl: {output_dir} is in use by another run ({holder}); wait for it to finish, or "
                         "choose another --output_dir") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


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


# ---------------------------------------------------------------------------------------------- what a run reaches
# What to `pip install` for a `--report_to` tracker whose package is not named as the tracker is.
_TRACKER_PACKAGES = {"comet_ml": "comet-ml", "azure_ml": "azureml-core", "flyte": "flytekit"}


def check_trackers(report_to) -> None:
    """Fail in one line on a `--report_to` tracker that is unknown or not installed (transformers would raise a
    traceback when the trainer is built, after the model has loaded): checked at configuration, dry runs included.
    Which trackers exist and which are installed is transformers' own answer."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise SystemExit(f"topr-trl: --report_to {name}: unknown tracker; choose among none, "
                             f"{', '.join(INTEGRATION_TO_CALLBACK)}")
        if name not in get_available_reporting_integrations():
            package = _TRACKER_PACKAGES.get(name, name)
            raise SystemExit(f"topr-trl: --report_to {name} needs the `{package}` package, which is not installed: "
                             f"pip install {package} (or choose --report_to tensorboard, installed with topr-trl, or "
                             "none)")


def check_vllm_server_mode(training_args) -> None:
    """`--use_vllm true --vllm_mode server` fails before anything loads, in one line, when the server cannot follow the
    policy: unreachable, or without a weight path this machine can drive. TRL pushes weights into a server by NCCL
    (CUDA only); `topr-trl vllm-serve` runs a gloo path too, the default without a GPU."""
    if not (training_args.use_vllm and training_args.vllm_mode == "server"):
        return

    url = server_url(training_args)
    backend = server_weight_backend(url, training_args.vllm_server_timeout)
    if backend == BACKEND or (backend == "nccl" and gpu_available()):
        return
    if backend == "nccl":
        raise SystemExit(f"topr-trl: the vLLM server at {url} takes weights by NCCL, which needs a GPU here too: "
                         "restart it with `topr-trl vllm-serve --model MODEL` (its gloo weight path, the default "
                         "without a GPU)")
    raise SystemExit(f"topr-trl: the vLLM server at {url} has no weight path the trainer can use "
                     f"({backend or 'none'}): start it with `topr-trl vllm-serve --model MODEL`")


def check_hub_push(training_args) -> None:
    """`--push_to_hub` fails before training, in one line, when it cannot succeed: the Hub out of reach or no token
    (otherwise TRL's trainer dies on a connection traceback when it creates the repository, or the push after hours of
    training fails)."""
    if not training_args.push_to_hub:
        return

    reason = hub_unreachable_reason()
    if reason is not None:
        raise SystemExit(f"topr-trl: --push_to_hub needs the Hugging Face Hub, which cannot be reached ({reason}); "
                         "train without it and push the saved folder later with `hf upload REPO_ID OUTPUT_DIR`")
    if get_token() is None:
        raise SystemExit("topr-trl: --push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN "
                         "(or train without --push_to_hub and push the saved folder later)")


@contextlib.contextmanager
def push_failure_reported(output_dir: str, pushing: bool):
    """Around what pushes a saved run (TrainingArguments' save_model pushes too, under --push_to_hub): a failure of
    the push (the network gone since the start) says, in one line, that the model is on disk, where, and how to push
    it later; nothing trained is lost."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any failure of the push leaves the same advice
        saved = any((Path(output_dir) / name).exists() for name in ("config.json", "adapter_config.json"))
        if not pushing or not saved:
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise SystemExit(f"topr-trl: the model is saved in {shown_path(output_dir)}, but pushing it to the Hub failed "
                         f"({type(error).__name__}: {first_line}); push it later with `hf upload REPO_ID "
                         f"{shown_path(output_dir)}`") from None


class LogLastStep(TrainerCallback):
    """Logs the last step whatever `logging_steps` is, so that a run shorter than the logging interval (or one that
    ends between two logs) still reports its last loss, reward and TOPR's metrics."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True
        return control


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


def interrupted_run(command: str, argv: list[str], output_dir: str) -> SystemExit:
    """`interrupted` for a training run: where the last checkpoint is and the command that resumes it, or that none
    was saved."""
    checkpoint = last_checkpoint(output_dir)
    if checkpoint is None:
        return interrupted(f"no checkpoint was saved yet in {shown_path(output_dir)} (see --save_steps), so a rerun "
                           "of the same command starts again")
    kept, skip_value = [], False
    for argument in argv:  # the earlier --resume_from_checkpoint (and its value) gives way to `true`
        if skip_value and not argument.startswith("-"):
            skip_value = False
            continue
        skip_value = argument == "--resume_from_checkpoint"
        if not skip_value and not argument.startswith("--resume_from_checkpoint="):
            kept.append(argument)
    return interrupted(f"the last checkpoint is {shown_path(checkpoint)}; resume with: "
                       f"{shlex.join([*command_line(command), *kept, '--resume_from_checkpoint', 'true'])}")


LAUNCHER_ENV = "TOPR_TRL_LAUNCHER"  # set by scripts/train.sh: the command its user typed, before the arguments


def command_line(command: str) -> list[str]:
    """How the user who ran `command` runs it again, as they can paste it: `bash <repo>/scripts/train.sh` for that
    script's user (`LAUNCHER_ENV`), the console script by its path where `topr-trl` on the PATH is not it (or there
    is none), else `topr-trl`."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and command == "train":
        return shlex.split(launcher)
    script = Path(sys.argv[0])
    on_path = shutil.which("topr-trl")
    if script.name == "topr-trl" and (on_path is None or Path(on_path).resolve() != script.resolve()):
        return [shown_path(str(script)), command]
    return ["topr-trl", command]


class _UnmeasuredMetricFilter(logging.Filter):
    """TRL logs a metric that no sample measured at a step (TOPR's ratios of a batch without negatives, a reward no
    completion could be given) as None; TensorBoard's callback then warns once per such key at every log, which says
    nothing a user can act on and buries the run's own lines. Only those warnings are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "of type <class 'NoneType'>" not in record.getMessage()


def quiet_unmeasured_metrics() -> None:
    """Drop those warnings (once per process: a second call adds nothing)."""
    integrations = logging.getLogger("transformers.integrations.integration_utils")
    if not any(isinstance(existing, _UnmeasuredMetricFilter) for existing in integrations.filters):
        integrations.addFilter(_UnmeasuredMetricFilter())
