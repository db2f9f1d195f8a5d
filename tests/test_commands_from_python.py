"""The commands called from Python, as TRL's scripts are (`main(script_args, training_args, model_args)` behind a
parser): `train`, `generate` and `iterate` on the dataclasses `parse_command` returns give what the command line gives
with the same flags; `train` takes dataclasses built by hand; nothing below the command line reads `sys.argv`; and
what only the command line knows (the command that resumes a run, a flag against a key of the config file) is said
in Python's terms when the run was called from Python."""

import ast
import json
import sys
from pathlib import Path

import pytest
from trl import ModelConfig

from topr_trl import TOPRConfig
from topr_trl.commands import (
    Invocation,
    TrainScriptArguments,
    generate,
    iterate,
    parse_command,
    parse_command_line,
    train,
)
from topr_trl.commands.cli import main
from topr_trl.commands.interruption import interrupted_run
from topr_trl.offline import load_offline_dataset

from .launching import as_flags, builtin_generate_flags, builtin_run_flags


PACKAGE = Path(__file__).resolve().parents[1] / "topr_trl"
# What varies between two identical runs, or names the run's own folder.
RUN_SPECIFIC = ("output_dir", "machine", "seconds", "behaviour_model")


def builtin_flags(base: Path) -> list[str]:
    """The built-in task on the tiny model, small enough for seconds (no warm start)."""
    return builtin_run_flags(base, per_device_train_batch_size=4, num_generations=4)


def same_run(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key not in RUN_SPECIFIC}


def files_of(folder: Path) -> set[str]:
    """The run's files by path (TensorBoard's event files carry the host and time in their names: only their folder)."""
    return {
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and "events.out.tfevents" not in path.name
    }


def test_train_from_python_gives_what_the_command_line_gives_and_reads_no_sys_argv(tmp_path, monkeypatch):
    flags = [*builtin_flags(tmp_path / "base"), "--max_steps", "2"]
    main(["train", *flags, "--output_dir", str(tmp_path / "cli")])
    script_args, training_args, model_args = parse_command("train", [*flags, "--output_dir", str(tmp_path / "python")])
    # whatever the process was started with: the run reads only the dataclasses it is given
    monkeypatch.setattr(sys, "argv", ["garbage", "--no_such_flag", "--output_dir", str(tmp_path / "not-here")])
    summary = train(script_args, training_args, model_args)
    assert not (tmp_path / "not-here").exists()
    from_cli = json.loads((tmp_path / "cli" / "topr_summary.json").read_text())
    assert summary == json.loads((tmp_path / "python" / "topr_summary.json").read_text())
    assert summary["steps"] == 2 and {"before", "after"} <= set(summary)
    assert same_run(summary) == same_run(from_cli)
    assert files_of(tmp_path / "python") == files_of(tmp_path / "cli")
    assert (tmp_path / "python" / "model.safetensors").is_file() and (tmp_path / "python" / "curves.png").is_file()


def test_train_takes_dataclasses_built_by_hand(tmp_path):
    """No parser: TRL's ScriptArguments-based arguments, a TOPRConfig and a ModelConfig as a Python user writes them
    (the built-in recipe's sizes, nothing reported)."""
    script_args = TrainScriptArguments(
        task_train_prompts=16, task_eval_prompts=8, warm_start_accuracy=0, base_model_dir=str(tmp_path / "base")
    )
    training_args = TOPRConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=2e-4,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        report_to="none",
    )
    summary = train(script_args, training_args, ModelConfig())
    assert summary["steps"] == 2 and summary["task"] == "arithmetic" and {"before", "after"} <= set(summary)
    assert json.loads((tmp_path / "run" / "topr_summary.json").read_text()) == summary
    assert (tmp_path / "run" / "model.safetensors").is_file() and not (tmp_path / "run" / "runs").exists()


def test_generate_and_iterate_from_python_give_what_the_command_line_gives(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["garbage", "--iterations", "7"])
    flags = builtin_generate_flags(tmp_path / "base")
    main(["generate", *flags, "--output_dir", str(tmp_path / "data-cli")])
    summary = generate(*parse_command("generate", [*flags, "--output_dir", str(tmp_path / "data-python")]))
    assert summary["rows"] == 16 and summary["prompts"] == 4
    from_cli, from_python = (load_offline_dataset(tmp_path / name) for name in ("data-cli", "data-python"))
    assert from_python.to_dict() == from_cli.to_dict()
    assert summary["proportion_of_positives"] == sum(reward > 0 for reward in from_cli["reward"]) / 16
    assert files_of(tmp_path / "data-python") == files_of(tmp_path / "data-cli")

    flags = [
        "--iterations",
        "1",
        *builtin_run_flags(tmp_path / "base", 4, 4, num_generations=4, per_device_train_batch_size=8),
    ]
    main(["iterate", *flags, "--output_dir", str(tmp_path / "it-cli")])
    (summary,) = iterate(*parse_command("iterate", [*flags, "--output_dir", str(tmp_path / "it-python")]))
    (from_cli,) = [json.loads(path.read_text()) for path in (tmp_path / "it-cli").glob("iteration-*/summary.json")]
    assert summary["rows"] == 16 and "evaluation" in summary
    assert same_run(summary) == same_run(from_cli)
    assert files_of(tmp_path / "it-python") == files_of(tmp_path / "it-cli")


def test_an_interrupted_train_from_python_names_the_argument_that_resumes_it(tmp_path, monkeypatch, capsys):
    """Ctrl-C at the end of step 2 (the flag InterruptAtStepEnd's signal handler sets, set here by the test): from
    Python the run names `training_args.resume_from_checkpoint`, not a command line the user never typed; the
    same folder resumed that way finishes the run."""
    from topr_trl.commands.interruption import InterruptAtStepEnd

    def ctrl_c_at_step_2(self, args, state, control, **kwargs):
        self.requested = self.requested or state.global_step == 2
        return original(self, args, state, control, **kwargs)

    original = InterruptAtStepEnd.on_step_end
    monkeypatch.setattr(InterruptAtStepEnd, "on_step_end", ctrl_c_at_step_2)
    output = tmp_path / "run"
    flags = [
        *builtin_flags(tmp_path / "base"),
        *as_flags(max_steps=3, save_strategy="steps", save_steps=1, output_dir=output),
    ]
    script_args, training_args, model_args = parse_command("train", flags)
    with pytest.raises(SystemExit) as stop:
        train(script_args, training_args, model_args)
    assert stop.value.code == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("topr-trl: interrupted; the last checkpoint is ") and "checkpoint-1" in line
    assert line.endswith("resume by calling train again with training_args.resume_from_checkpoint=True")
    assert "--resume_from_checkpoint" not in line

    monkeypatch.setattr(InterruptAtStepEnd, "on_step_end", original)
    script_args, training_args, model_args = parse_command("train", flags)
    training_args.resume_from_checkpoint = True  # as the line says
    assert train(script_args, training_args, model_args)["steps"] == 3


def test_what_only_the_command_line_knows_is_said_in_python_terms_from_python(tmp_path, capsys):
    """The resume line without a checkpoint and with one, and a reward-weight count that does not match, each worded
    for the command line with an `Invocation` and for Python without."""
    folder = tmp_path / "run"
    folder.mkdir()
    invocation = Invocation(launcher=("topr-trl", "train"), arguments=("--max_steps", "9"))
    assert interrupted_run(str(folder), invocation).code == 130
    assert "(see --save_steps), so a rerun of the same command starts again" in capsys.readouterr().err
    interrupted_run(str(folder), None)
    assert "(see training_args.save_steps), so calling train again starts again" in capsys.readouterr().err
    (folder / "checkpoint-4").mkdir()
    (folder / "checkpoint-4" / "trainer_state.json").write_text("{}")
    interrupted_run(str(folder), invocation)
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("resume with: topr-trl train --max_steps 9 --resume_from_checkpoint true")
    )

    flags = ["--reward_weights", "1", "2", "--dry_run", "true", "--output_dir", str(tmp_path / "dry")]
    with pytest.raises(SystemExit, match=r"^topr-trl: --reward_weights gives 2 weight\(s\) for 1 reward"):
        main(["train", *flags])
    with pytest.raises(SystemExit, match=r"^topr-trl: reward_weights gives 2 weight\(s\) for 1 reward"):
        train(*parse_command("train", flags))
    config = tmp_path / "weights.yaml"
    config.write_text("reward_weights: [1, 2]\n")
    with pytest.raises(SystemExit, match=r"^topr-trl: reward_weights \(set in the config file\) gives 2 weight"):
        main(["train", "--config", str(config), *flags[3:]])


def test_the_parse_records_what_the_user_set():
    """`parse_command_line` decides once what the runs used to read from argv again: the fields set by flags (`--no_X`
    by its field) and by the config file, how the user ran the command, and what the hardware defaults set."""
    from topr_trl.runtime.distributed import gpu_available

    (script_args, training_args, _), invocation = parse_command_line(
        "train",
        ["--model_name_or_path", "some/model", "--reward_weights=1", "--no_shuffle_dataset", "--dry_run", "true"],
        launcher=["bash", "scripts/train.sh"],
    )
    assert invocation.flags >= {"model_name_or_path", "reward_weights", "shuffle_dataset", "dry_run"}
    assert invocation.launcher == ("bash", "scripts/train.sh") and invocation.arguments[0] == "--model_name_or_path"
    assert training_args.reward_weights == [1.0] and not training_args.shuffle_dataset and script_args.dry_run
    assert not invocation.set_by_user("use_cpu") and not invocation.set_by_user("learning_rate")
    assert invocation.moved_to_the_cpu() == (not gpu_available())  # a custom run: TRL's defaults, fitted here
    _, on_the_cpu = parse_command_line("train", ["--model_name_or_path", "some/model", "--use_cpu", "true"])
    assert on_the_cpu.set_by_user("use_cpu") and not on_the_cpu.moved_to_the_cpu()
    _, builtin = parse_command_line("train", [])
    assert builtin.launcher == ("topr-trl", "train") and not builtin.hardware_defaults


def test_only_the_command_line_reads_sys_argv():
    """The console script (`cli.main`) and evaluate's own entry point read `sys.argv`, and the parser falls back to
    it as TRL's does when given nothing; no run, check or library module does."""
    allowed = {"commands/cli.py", "commands/evaluate.py", "commands/arguments.py"}
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "argv" and getattr(node.value, "id", None) == "sys":
                readers.add(str(path.relative_to(PACKAGE)))
    assert readers <= allowed, readers - allowed


def test_a_commands_generation_ends_ctrl_c_in_one_line_and_names_a_refused_folders_settings_as_flags(tmp_path, capsys):
    from topr_trl.commands.interruption import generation_ended_in_one_line
    from topr_trl.offline.generation import GeneratedWithOtherSettings, SettingChange

    with pytest.raises(SystemExit) as stopped, generation_ended_in_one_line("the shards are kept", lambda _: ""):
        raise KeyboardInterrupt
    assert stopped.value.code == 130  # as a shell reports an interrupted program
    assert capsys.readouterr().err.strip() == "topr-trl: interrupted; the shards are kept"

    folder = tmp_path / "run" / "iteration-002" / "data"
    change = SettingChange("temperature", 0.5, 1.0, None)
    with (
        pytest.raises(GeneratedWithOtherSettings) as refused,
        generation_ended_in_one_line("", lambda where: f"delete {where.parent.name}"),
    ):
        raise GeneratedWithOtherSettings(folder, [change])  # as the library raises it: Python's names
    message = str(refused.value)
    assert "--temperature 0.5 -> 1.0" in message and message.endswith(": delete iteration-002")
