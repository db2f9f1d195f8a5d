"""What a command-line run leaves and how it ends, tried as a user would from a folder of their own with a model of
their own: its curves (a picture and TensorBoard's files), its last loss, one run per output folder at a time, Ctrl-C,
`--push_to_hub` without the Hub, trackers that are not installed, and the libraries the package needs."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset

from topr_trl.commands.cli import main
from topr_trl.commands.curves import logged_curves, plot_curves
from topr_trl.commands.output_folders import LOCK_FILE, output_dir_lock

from .conftest import SHARED
from .launching import SMALL_RUN, as_flags, run_cli, user_data_flags


ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(4)]
REWARD_MODULE = """
def correctness(completions, answer, **kwargs):
    return [1.0 if c.strip()[:1] == str(a)[:1] else -1.0 for c, a in zip(completions, answer)]
"""
# A random model's completions are mostly unscorable (the reward returns None): go on through them.
SMALL = as_flags(**SMALL_RUN, topr_unscored_batch="train")


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory, tiny_model_path) -> Path:
    """A user's folder outside the repository: a model that is not the built-in one (the shared tool's Qwen2 with a
    BPE tokenizer and tied embeddings where ../shared is present, else a random tiny model), prompts and a reward."""
    folder = tmp_path_factory.mktemp("user")
    maker = SHARED / "tools" / "user_folder" / "make_user_folder.py"
    if maker.is_file():
        subprocess.run([sys.executable, str(maker), str(folder)], check=True, capture_output=True, timeout=600)
    else:
        os.symlink(tiny_model_path, folder / "my-model")
        (folder / "data").mkdir()
        Dataset.from_dict({"prompt": PROMPTS, "answer": [str(eval(p[:-1])) for p in PROMPTS]}).to_json(
            folder / "data" / "prompts.jsonl"
        )
        (folder / "my_rewards.py").write_text(REWARD_MODULE)
    return folder


def user_run(folder: Path, output: str, *extra: str) -> list[str]:
    return [
        "train",
        *user_data_flags("my-model", "data/prompts.jsonl"),
        "--output_dir",
        output,
        *SMALL,
        *extra,
    ]


def topr_trl(argv: list[str], cwd: Path, **env) -> subprocess.Popen:
    # with SIGINT at its default in the child, as a command typed in a terminal has it (a test run started as a
    # background job of a script would pass on SIGINT ignored, and the Ctrl-C tests would test nothing)
    return subprocess.Popen(
        [sys.executable, "-m", "topr_trl", *argv],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1", **env},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(condition, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended first ({process.returncode}): {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("topr-trl:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------------------- what a run leaves
def test_a_run_leaves_its_curves_tensorboard_files_state_and_last_loss(user_folder):
    """Two steps at TRL's logging interval of 10: the last step is logged anyway, so the summary has the loss; the
    curves' picture is written and its path printed; TensorBoard's files (the default tracker) hold the same logged
    values as the trainer's state."""
    completed = run_cli(user_run(user_folder, "outputs/leaves", "--max_steps", "2"), user_folder)
    assert completed.returncode == 0, completed.stderr[-3000:]
    run = user_folder / "outputs" / "leaves"
    summary = json.loads((run / "topr_summary.json").read_text())
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    last = next(entry for entry in reversed(history) if "loss" in entry)
    assert last["step"] == 2 and summary["end_of_training"]["loss"] == pytest.approx(last["loss"], rel=1e-12)
    assert "reward" in summary["end_of_training"]
    assert "[topr-trl] curves drawn to outputs/leaves/curves.png" in completed.stdout
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with output_dir_lock(str(run)):  # the finished run holds the folder no more
        assert f"pid {os.getpid()} " in (run / LOCK_FILE).read_text()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {path.parent for path in (run / "runs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(events_dir))
    events.Reload()
    rewards = [(event.step, event.value) for event in events.Scalars("train/reward")]
    assert rewards == [
        (entry["step"], pytest.approx(entry["reward"], rel=1e-6)) for entry in history if "reward" in entry
    ]


def test_logged_curves_keep_every_logged_number_and_skip_nan():
    history = [
        {"step": 1, "loss": 0.5, "reward": -1.0, "topr/ratio_negative/mean": float("nan")},
        {"step": 2, "loss": 0.25, "eval_reward": 0.75, "learning_rate": 1e-4},
        {"step": 2, "train_runtime": 3.0, "train_loss": 0.375},
    ]
    curves = logged_curves(history, step_offset=10)
    assert curves == {"loss": ([11, 12], [0.5, 0.25]), "reward": ([11], [-1.0]), "eval_reward": ([12], [0.75])}


def test_each_reward_function_is_drawn_beside_the_sum_on_whole_steps(tmp_path):
    """TRL logs each function's mean as `rewards/<name>/mean`: the reward panel draws them with the sum (their std
    is not drawn), and the steps axis has whole-number ticks only."""
    from topr_trl.commands.curves import drawn_panels

    history = [
        {
            "step": s,
            "reward": 0.5 * s,
            "rewards/correctness/mean": s,
            "rewards/format/mean": -s,
            "rewards/format/std": 0.1,
            "loss": 1.0,
        }
        for s in (1, 2, 3)
    ]
    curves = logged_curves(history)
    panels = dict(drawn_panels(curves))
    assert panels["reward (training batches)"] == ["reward", "rewards/correctness/mean", "rewards/format/mean"]
    assert "rewards/format/std" not in curves

    from unittest import mock

    import matplotlib.pyplot as plt

    figures = []  # the figure drawn, kept open to read its axes
    original = plt.subplots
    with (
        mock.patch.object(plt, "subplots", lambda *a, **k: figures.append(original(*a, **k)) or figures[-1]),
        mock.patch.object(plt, "close", lambda figure: None),
    ):
        plot_curves(curves, tmp_path / "curves.png", "a run")
    ticks = [tick for axis in figures[0][1].flat if axis.get_visible() for tick in axis.get_xticks() if 1 <= tick <= 3]
    assert ticks and all(float(tick).is_integer() for tick in ticks)


def test_plot_curves_writes_a_png_or_nothing(tmp_path):
    assert plot_curves({}, tmp_path / "none.png", "empty") is None and not (tmp_path / "none.png").exists()
    path = plot_curves(
        logged_curves([{"step": s, "loss": 1 / s, "reward": s} for s in range(1, 5)]),
        tmp_path / "sub" / "curves.png",
        "a run",
        boundaries=[2],
    )
    assert path == tmp_path / "sub" / "curves.png" and path.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------------------- one run per folder
def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_run_leaves_it_free(user_folder):
    first = topr_trl(user_run(user_folder, "outputs/shared", "--max_steps", "500"), user_folder)
    lock = user_folder / "outputs" / "shared" / LOCK_FILE
    try:
        wait_for(lambda: lock.is_file() and "pid" in lock.read_text(), first)
        second = run_cli(user_run(user_folder, "outputs/shared", "--max_steps", "1"), user_folder)
        assert second.returncode == 1
        line = one_error_line(second.stderr)
        assert f"outputs/shared is in use by another run (pid {first.pid} " in line and "--output_dir" in line
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()  # SIGKILL: no Python code of the run's runs, as in a crash or an out-of-memory kill
        first.wait()
    # The kernel released the dead run's lock: the folder is free (here overwritten, since it holds the dead run).
    third = run_cli(
        user_run(user_folder, "outputs/shared", "--max_steps", "1", "--overwrite_output_dir", "true"), user_folder
    )
    assert third.returncode == 0, third.stderr[-3000:]


def test_the_lock_is_held_by_one_holder_at_a_time(tmp_path):
    with output_dir_lock(str(tmp_path / "run")):
        holder = (tmp_path / "run" / LOCK_FILE).read_text()
        assert f"pid {os.getpid()} " in holder
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from topr_trl.commands.output_folders import output_dir_lock\n"
                f"with output_dir_lock({str(tmp_path / 'run')!r}): pass",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert other.returncode == 1 and f"in use by another run (pid {os.getpid()} " in other.stderr
    with output_dir_lock(str(tmp_path / "run")):  # released on exit
        pass


def test_a_failed_run_leaves_no_folder_for_its_lock_alone(user_folder, monkeypatch):
    """The lock's file is not a file of the run: a run that fails once it holds the folder (here, building the
    trainer) leaves no folder behind, as before there was a lock."""
    from topr_trl.trainer import TOPRTrainer

    def broken(self, *args, **kwargs):
        raise ValueError("the model cannot be built")

    monkeypatch.setattr(TOPRTrainer, "__init__", broken)
    monkeypatch.chdir(user_folder)
    monkeypatch.syspath_prepend(str(user_folder))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of that name
    with pytest.raises(SystemExit) as stop:
        main(user_run(user_folder, "outputs/failed", "--max_steps", "1"))
    assert "the model cannot be built" in str(stop.value.code)
    assert not (user_folder / "outputs" / "failed").exists()


# ----------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("mode", [[], ["--asynchronous"]], ids=["synchronous", "asynchronous"])
def test_ctrl_c_says_where_the_last_checkpoint_is_and_the_command_that_resumes_it(mode, user_folder):
    """Also for an asynchronous run: its printed command resumes it, the rollout at the first prompt the checkpoint's
    steps did not train (`topr_trl.asynchronous.resume`), saying so in one line."""
    output = "outputs/interrupted" + "-asynchronous" * bool(mode)  # the folder fixture serves the whole module
    argv = user_run(user_folder, output, "--max_steps", "500", "--save_strategy", "steps", "--save_steps", "1", *mode)
    if mode:  # the asynchronous trainer has no unscored-batch rule (its rewards arrive sample by sample)
        at = argv.index("--topr_unscored_batch")
        del argv[at : at + 2]
    run = topr_trl(argv, user_folder)
    state = user_folder / output / "checkpoint-2" / "trainer_state.json"
    try:
        wait_for(state.is_file, run)
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 130, stderr[-3000:]
    line = one_error_line(stderr)
    assert "KeyboardInterrupt" not in stderr
    checkpoint = re.search(r"the last checkpoint is (\S+);", line).group(1)
    assert re.fullmatch(rf"{output}/checkpoint-\d+", checkpoint)
    command = shlex.split(line.split("resume with: ")[1])
    assert command == ["topr-trl", *argv, "--resume_from_checkpoint", "true"]
    # The printed command resumes the run (one more step than the checkpoint's, to be quick).
    step = int(checkpoint.rsplit("-", 1)[1])
    resumed = run_cli([*command[1:], "--max_steps", str(step + 1)], user_folder)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((user_folder / output / "topr_summary.json").read_text())
    assert summary["steps"] == step + 1
    if mode:
        state = json.loads((user_folder / checkpoint / "rollout_state.json").read_text())
        assert f"resuming from {checkpoint}: the rollout restarts at prompt {state['prompt_index']};" in resumed.stderr


def test_ctrl_c_in_training_is_never_lost_in_a_finaliser_and_a_second_one_interrupts_at_once():
    """The first SIGINT only sets a flag (Python would raise it wherever the main thread is, and a KeyboardInterrupt
    raised in a finaliser is printed as "ignored" and lost: the run went on to its last step), read at the end of the
    step; Python's handler is back for a second one; leaving the block restores the handler it found."""
    from topr_trl.commands.interruption import InterruptAtStepEnd

    found = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a terminal
    try:
        _interrupt_twice(signal.default_int_handler)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job ignores SIGINT: so does the run
        with InterruptAtStepEnd() as interrupt:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert not interrupt.requested and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, found)


def _interrupt_twice(before) -> None:
    from topr_trl.commands.interruption import InterruptAtStepEnd

    interrupt = InterruptAtStepEnd()
    with interrupt:
        interrupt.on_step_end(None, None, "control")  # nothing asked: the step ends normally
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs between bytecodes: no KeyboardInterrupt here
        assert interrupt.requested and signal.getsignal(signal.SIGINT) is before
        with pytest.raises(KeyboardInterrupt):
            interrupt.on_step_end(None, None, "control")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before


# ----------------------------------------------------------------------------------------- the Hub, trackers
def test_push_to_hub_without_the_hub_fails_before_training_in_one_line(user_folder):
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    completed = run_cli(
        user_run(user_folder, "outputs/pushed", "--max_steps", "1", "--push_to_hub", "true"),
        user_folder,
        environment=env,
        HF_ENDPOINT="http://127.0.0.1:9",
    )
    assert completed.returncode == 1
    line = one_error_line(completed.stderr)
    assert "--push_to_hub needs the Hugging Face Hub" in line and "127.0.0.1 cannot be reached" in line
    assert not (user_folder / "outputs" / "pushed").exists()


def test_a_push_that_fails_after_training_says_where_the_model_is(user_folder, monkeypatch):
    from topr_trl.trainer import TOPRTrainer

    def no_network(self, *args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'\nand 80 more lines")

    monkeypatch.setattr("topr_trl.commands.runs.check_hub_push", lambda args: None)  # the Hub was there at the start
    monkeypatch.setattr(TOPRTrainer, "init_hf_repo", lambda self, *a, **k: setattr(self, "push_in_progress", None))
    monkeypatch.setattr(TOPRTrainer, "_push_from_checkpoint", lambda self, *a, **k: None)
    monkeypatch.setattr(TOPRTrainer, "push_to_hub", no_network)
    monkeypatch.chdir(user_folder)
    monkeypatch.syspath_prepend(str(user_folder))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of that name
    output = user_folder / "outputs" / "push-failed"
    with pytest.raises(SystemExit) as stop:
        main(user_run(user_folder, "outputs/push-failed", "--max_steps", "1", "--push_to_hub", "true"))
    text = str(stop.value.code)
    assert text.startswith("topr-trl: the model is saved in outputs/push-failed, but pushing") and "\n" not in text
    assert "ConnectionError: Failed to resolve 'huggingface.co')" in text and "hf upload" in text
    assert (output / "model.safetensors").is_file() and (output / "topr_summary.json").is_file()


@pytest.mark.parametrize(
    "tracker, message",
    [
        ("wandb", "--report_to wandb needs the `wandb` package, which is not installed: pip install wandb"),
        ("tensorbord", "--report_to tensorbord: unknown tracker"),
    ],
)
def test_a_tracker_that_cannot_run_fails_in_one_line_even_in_a_dry_run(tracker, message, user_folder, monkeypatch):
    import importlib.util

    if tracker == "wandb" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    monkeypatch.chdir(user_folder)
    monkeypatch.syspath_prepend(str(user_folder))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of that name
    for dry_run in ("true", "false"):
        with pytest.raises(SystemExit) as stop:
            main(
                user_run(
                    user_folder, "outputs/tracked", "--max_steps", "1", "--report_to", tracker, "--dry_run", dry_run
                )
            )
        text = str(stop.value.code)
        assert text.startswith("topr-trl: ") and "\n" not in text and message in text
    assert not (user_folder / "outputs" / "tracked").exists()


# ----------------------------------------------------------------------------------------- the install
# Imported only on the paths of an optional extra (or by TRL on a path of its own), never on a plain install's.
OPTIONAL_MODULES = {"vllm", "deepspeed"}


def test_every_library_the_package_imports_is_installed_with_it():
    """A plain `pip install topr-trl` must run every command: each third-party module imported anywhere in the
    package (at the top or inside a function) comes from a distribution in install_requires, or is an extra's."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    required = {
        re.split(r"[<>=!~;\[ ]", line.strip())[0].lower().replace("_", "-")
        for line in config["options"]["install_requires"].splitlines()
        if line.strip() and not line.strip().startswith("#")
    }
    imported = set()
    for path in (ROOT / "topr_trl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"topr_trl"} - OPTIONAL_MODULES
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(third_party):
        names = {name.lower().replace("_", "-") for name in distributions.get(module, [module])}
        if not names & required:
            missing[module] = sorted(names)
    assert not missing, f"imported by topr_trl but not in install_requires: {missing}"
    assert {"matplotlib", "tensorboard"} <= required


# ----------------------------------------------------------------------------------------- what the README says
def test_the_readme_states_grpo_defaults_as_grpo_has_them():
    """The custom run's defaults as the README states them are GRPOConfig's own (TRL 1.16: 512-token completions),
    and `generate` samples as long as `train` trains by default."""
    from trl import GRPOConfig

    from topr_trl.commands.arguments import GenerateScriptArguments

    readme = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(
        r"`GRPOConfig` defaults \(learning rate ([\d.e-]+), (\d+)-token completions, (\d+) epochs, "
        r"checkpoints every (\d+) steps",
        readme,
    )
    defaults = GRPOConfig.__dataclass_fields__
    assert stated and float(stated.group(1)) == defaults["learning_rate"].default
    assert int(stated.group(2)) == defaults["max_completion_length"].default
    assert float(stated.group(3)) == defaults["num_train_epochs"].default
    assert int(stated.group(4)) == defaults["save_steps"].default
    assert (
        GenerateScriptArguments.__dataclass_fields__["max_completion_length"].default
        == defaults["max_completion_length"].default
    )
    assert "`use_cpu=True, bf16=False`" in readme  # what a Python user on a CPU needs, said at the swap


def test_a_folder_that_cannot_be_locked_runs_unlocked_and_says_so(tmp_path, monkeypatch, capsys):
    """A file system without locks (ENOLCK on some network mounts) is not "in use by another run": the run goes on
    and says that a second run would not be refused."""
    import errno
    import fcntl

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with output_dir_lock(str(tmp_path / "run")):
        pass
    assert "cannot be locked (No locks available): a second run into it would not be refused" in capsys.readouterr().out


def test_vllm_server_mode_without_a_server_fails_in_one_line_naming_it_before_anything_loads(user_folder):
    """Server mode with no server at the address: the run stops before the model loads, in one line naming the
    address and the command that starts one, after waiting `--vllm_server_timeout` for it (TRL's own wait)."""
    completed = run_cli(
        user_run(
            user_folder,
            "outputs/server",
            "--max_steps",
            "1",
            "--use_vllm",
            "true",
            "--vllm_mode",
            "server",
            "--vllm_server_base_url",
            "http://127.0.0.1:9",
            "--vllm_server_timeout",
            "3",
        ),
        user_folder,
    )
    assert completed.returncode == 1
    line = one_error_line(completed.stderr)
    assert "the vLLM server at http://127.0.0.1:9 cannot be reached" in line and "topr-trl vllm-serve" in line
    assert not (user_folder / "outputs" / "server").exists()


def test_resuming_where_there_is_nothing_to_continue_is_refused_and_the_finished_run_kept(user_folder):
    """`--resume_from_checkpoint true` that would not continue a run says so in one line, as the user runs it: on a
    folder with no run (it would start from scratch), on a finished run saved without checkpoints (it would train
    it again from step 0 and rewrite it), and on a finished run whose last checkpoint already reached `--max_steps`
    (it would train a step past it and overwrite the model). The finished run's model is left as it was."""
    empty = topr_trl(
        user_run(user_folder, "nothing-here", "--max_steps", "1", "--resume_from_checkpoint", "true"), user_folder
    )
    _, stderr = empty.communicate(timeout=300)
    assert empty.returncode != 0 and "nothing-here holds no checkpoint to continue from" in one_error_line(stderr)
    assert not (user_folder / "nothing-here").exists()

    for output, saving in (("unsaved", ["--save_strategy", "no"]), ("saved", ["--save_steps", "1"])):
        finished = topr_trl(user_run(user_folder, output, "--max_steps", "1", *saving), user_folder)
        assert finished.wait(timeout=600) == 0
        model = (user_folder / output / "model.safetensors").read_bytes()
        again = topr_trl(
            user_run(user_folder, output, "--max_steps", "1", *saving, "--resume_from_checkpoint", "true"), user_folder
        )
        _, stderr = again.communicate(timeout=300)
        line = one_error_line(stderr)
        assert again.returncode != 0 and (user_folder / output / "model.safetensors").read_bytes() == model
        if output == "unsaved":
            assert "holds no checkpoint to continue from" in line and "--overwrite_output_dir true" in line, line
        else:
            assert "checkpoint-1 already reached step 1, so --max_steps 1 leaves nothing to train" in line, line
        # the refusal of the finished folder suggests resuming only where a checkpoint is there to resume from
        plain = topr_trl(user_run(user_folder, output, "--max_steps", "1", *saving), user_folder)
        _, stderr = plain.communicate(timeout=300)
        assert ("--resume_from_checkpoint" in one_error_line(stderr)) == (output == "saved")
