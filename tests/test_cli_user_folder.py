"""The command line run from a user's own folder, with their files, wrong inputs and interrupted runs (issue 18)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from topr_trl.commands import cli
from topr_trl.commands.arguments import TaskArguments
from topr_trl.commands.cli import main

from .launching import run_cli, user_data_flags
from .test_cli_user_path import OFFLINE_STEP, PROMPTS, QUICK, generate_builtin, prompt_dataset


ROOT = Path(__file__).resolve().parents[1]
# Raises on one prompt only, so that the one-line report must name the right one.
FAILING_REWARD = """
def fragile(prompts, completions, **kwargs):
    for prompt in prompts:
        if prompt == "2+1=":
            raise KeyError("no grader for " + prompt)
    return [0.0 for _ in completions]
"""


def one_line_error(stop: pytest.ExceptionInfo) -> str:
    text = str(stop.value.code)
    assert text.startswith("topr-trl: ") and "\n" not in text, text
    return text


# ----------------------------------------------------------------------------------------- offline splits
@pytest.fixture(scope="module")
def offline_folder(tmp_path_factory):
    """An offline folder as a user keeps it: train.jsonl and test.jsonl, disjoint prompts."""
    root = tmp_path_factory.mktemp("offline-splits")
    generate_builtin(root, 8, "generated")
    from topr_trl.offline import load_offline_dataset

    data = load_offline_dataset(root / "generated")
    (root / "data").mkdir()
    data.filter(lambda row: row["prompt_index"] < 4).to_json(root / "data" / "train.jsonl")
    data.filter(lambda row: row["prompt_index"] >= 4).to_json(root / "data" / "test.jsonl")
    return root


def test_offline_folder_trains_on_train_and_evaluates_on_test(offline_folder, user_dir):
    """The test split's prompts reach the reward function only as the evaluation set."""

    def prompts_of(split: str) -> set[str]:
        rows = [json.loads(line) for line in (offline_folder / "data" / f"{split}.jsonl").read_text().splitlines()]
        return {row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"] for row in rows}

    common = [
        "train",
        "--offline_dataset",
        str(offline_folder / "data"),
        "--reward_funcs",
        "my_rewards:correctness",
        "--base_model_dir",
        str(offline_folder / "base"),
        *OFFLINE_STEP,
        "--task_eval_prompts",
        "4",
    ]
    main(common + ["--output_dir", "train-only"])
    seen = {p[-1]["content"] if isinstance(p, list) else p for p in _seen_raw(user_dir)}
    assert seen == prompts_of("train")
    (user_dir / "seen.jsonl").unlink()
    main(
        common
        + [
            "--output_dir",
            "with-eval",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "1",
            "--per_device_eval_batch_size",
            "16",
        ]
    )
    seen = {p[-1]["content"] if isinstance(p, list) else p for p in _seen_raw(user_dir)}
    assert seen == prompts_of("train") | prompts_of("test")
    history = json.loads((user_dir / "with-eval" / "topr_summary.json").read_text())
    assert "eval_reward" in history["end_of_training"]


def _seen_raw(directory: Path) -> list:
    return [prompt for line in (directory / "seen.jsonl").read_text().splitlines() for prompt in json.loads(line)]


def test_offline_folder_without_the_split_asked_for_fails_in_one_line(offline_folder, user_dir):
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "train",
                "--offline_dataset",
                str(offline_folder / "data"),
                "--dataset_train_split",
                "validation",
                "--base_model_dir",
                str(offline_folder / "base"),
            ]
        )
    assert "has no 'validation' split" in one_line_error(stop) and "['test', 'train']" in str(stop.value.code)


# ----------------------------------------------------------------------------------------- interrupted runs
def test_an_interrupted_run_is_not_restarted_over_its_checkpoints(user_dir, tiny_model_path):
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    command = [
        "train",
        *user_data_flags(tiny_model_path, "prompts.jsonl"),
        "--output_dir",
        "run",
        *QUICK,
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
    ]
    main(command)
    for finished in ("model.safetensors", "topr_summary.json"):  # as if stopped after the checkpoint
        (user_dir / "run" / finished).unlink()
    state = (user_dir / "run" / "checkpoint-1" / "trainer_state.json").read_text()
    with pytest.raises(SystemExit) as stop:
        main(command)
    message = one_line_error(stop)
    assert "interrupted run (last checkpoint checkpoint-1)" in message and "--resume_from_checkpoint true" in message
    assert (user_dir / "run" / "checkpoint-1" / "trainer_state.json").read_text() == state
    main(command + ["--resume_from_checkpoint", "true", "--max_steps", "2"])
    summary = json.loads((user_dir / "run" / "topr_summary.json").read_text())
    assert summary["steps"] == 2 and (user_dir / "run" / "checkpoint-2").is_dir()


# ----------------------------------------------------------------------------------------- wrong inputs
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model_name_or_path", "./nosuch-model"], "model folder ./nosuch-model does not exist"),
        (["--model_name_or_path", "no/such/model-dir"], "model folder no/such/model-dir does not exist"),
        (
            ["--model_name_or_path", "no/such-model-dir"],
            "no/such-model-dir is not a local folder, and the Hub cannot be asked for it (HF_HUB_OFFLINE is set)",
        ),
        (
            ["--model_name_or_path", "MODEL", "--dataset_name", "data/missing.jsonl"],
            "--dataset_name data/missing.jsonl: no such file or folder",
        ),
        (["--learning_rate", "abc"], "--learning_rate: invalid float value: 'abc'"),
        (["--max_steps", "two"], "--max_steps: invalid int value: 'two'"),
        (["--bf16", "maybe"], "--bf16: Truthy value expected: got maybe"),
        (["--topr_unscored_batch", "stop"], "topr_unscored_batch"),
        (["--lora_r", "8"], "--lora_r sets the LoRA adapter, which only --use_peft true trains"),
        (["--use_dora", "true"], "--use_dora sets the LoRA adapter"),
        (["--max_steps", "0"], "--max_steps 0 would not stop training at step 0"),
    ],
)
@pytest.mark.parametrize("dry_run", [False, True])
def test_wrong_input_fails_at_once_in_one_line(argv, message, dry_run, user_dir, tiny_model_path):
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    defaults = {"--model_name_or_path": tiny_model_path, "--dataset_name": "prompts.jsonl"}
    argv = [tiny_model_path if a == "MODEL" else a for a in argv]
    for flag, value in defaults.items():
        if flag not in argv:
            argv += [flag, value]
    argv += ["--reward_funcs", "my_rewards:correctness"] + (["--dry_run", "true"] if dry_run else [])
    if dry_run and "Hub cannot be asked" in message:  # a dry run validates Hub ids without asking the Hub
        main(["train", *argv])
        return
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert message in one_line_error(stop)


def test_a_wrong_yaml_value_names_the_key(user_dir):
    (user_dir / "run.yaml").write_text("learning_rate: abc\nmax_steps: 3\n")
    with pytest.raises(SystemExit) as stop:
        main(["train", "--config", "run.yaml"])
    assert one_line_error(stop) == "topr-trl: --learning_rate: invalid float value: 'abc' (set in the config file)"
    main(["train", "--config", "run.yaml", "--learning_rate", "1e-3", "--dry_run", "true"])  # the flag wins


def test_a_model_name_the_hub_cannot_be_asked_for_fails_at_once(monkeypatch):
    """Online but unreachable: no retries, one line."""
    import time

    from huggingface_hub import constants

    from topr_trl.inputs import sources

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    started = time.time()
    with pytest.raises(SystemExit) as stop:
        sources.resolve_model_source("no/such-model-dir", convert=False)
    assert "127.0.0.1 cannot be reached" in one_line_error(stop) and time.time() - started < 5


def test_a_raising_reward_function_is_reported_in_one_line(user_dir, tiny_model_path):
    (user_dir / "graders.py").write_text(FAILING_REWARD)
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    argv = [
        "train",
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        "prompts.jsonl",
        "--reward_funcs",
        "graders:fragile",
        "--per_device_train_batch_size",
        "16",
        "--num_generations",
        "2",
        "--max_steps",
        "1",
        "--max_completion_length",
        "4",
        "--output_dir",
        "run",
    ]
    completed = run_cli(argv, user_dir)
    errors = [line for line in completed.stderr.splitlines() if line.startswith("topr-trl:")]
    assert completed.returncode == 1 and "Traceback" not in completed.stderr, completed.stderr[-2000:]
    assert len(errors) == 1
    assert "reward function 'fragile' raised KeyError: 'no grader for 2+1='" in errors[0]
    assert "on prompt '2+1='" in errors[0]
    assert not (user_dir / "run").exists()  # a failed run leaves no empty output folder
    debug = run_cli(argv + ["--debug"], user_dir)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "KeyError" in debug.stderr


# ----------------------------------------------------------------------------------------- evaluate
def test_evaluate_scores_the_users_prompts_with_the_users_reward(user_dir, tiny_model_path, capsys):
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    evaluate = ["evaluate", "--model_name_or_path", tiny_model_path, "--dataset_name", "prompts.jsonl"]
    with pytest.raises(SystemExit) as stop:
        main(evaluate)
    assert "needs --dataset_name" in one_line_error(stop) and "--reward_funcs" in str(stop.value.code)
    with pytest.raises(SystemExit) as stop:
        main([*evaluate, "--task", "arithmetic"])
    assert "drop --dataset_name" in one_line_error(stop)
    main(
        [
            *evaluate,
            "--dataset_test_split",
            "train",
            "--reward_funcs",
            "my_rewards:correctness",
            "--k",
            "2",
            "--max_completion_length",
            "3",
            "--output_dir",
            "eval",
            "--no_plot",
            "--no_progress",
        ]
    )
    results = json.loads((user_dir / "eval" / "results.json").read_text())
    assert [record["prompt"] for record in results["records"]] == PROMPTS
    # the user's reward, recomputed: the completion's first character against the answer's
    answers = prompt_dataset()["answer"]
    for record in results["records"]:
        expected = ["correct" if c[:1] == answers[record["index"]][:1] else "incorrect" for c in record["completions"]]
        assert record["classes"] == expected
        assert record["reference"] == {"answer": answers[record["index"]]}  # the row's reference, not its index
    from topr_trl.runtime.machine import machine_info

    assert results["settings"]["machine"] == machine_info()
    assert "reward > 0" in capsys.readouterr().out


def test_evaluate_bad_value_fails_in_one_line(tiny_model_path):
    with pytest.raises(SystemExit) as stop:
        main(["evaluate", "--model_name_or_path", tiny_model_path, "--k", "two"])
    assert "--k: invalid int value: 'two'" in one_line_error(stop)


# ----------------------------------------------------------------------------------------- what a run leaves
def test_summary_model_card_and_output_folders_of_a_custom_run(user_dir, tiny_model_path):
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    prompt_dataset().to_parquet(user_dir / "prompts.parquet")
    for source in ("prompts.jsonl", "prompts.parquet"):
        main(
            [
                "train",
                *user_data_flags(tiny_model_path, source),
                *QUICK,
                "--logging_steps",
                "1",
            ]
        )
    name = Path(tiny_model_path).name
    jsonl, parquet = (user_dir / "outputs" / f"topr-{name}-prompts-{kind}" for kind in ("jsonl", "parquet"))
    assert (jsonl / "model.safetensors").is_file() and (parquet / "model.safetensors").is_file()
    summary = json.loads((jsonl / "topr_summary.json").read_text())
    assert set(summary["end_of_training"]) >= {"loss", "reward"} and summary["steps"] == 1
    from topr_trl.runtime.machine import machine_info

    assert summary["machine"] == machine_info()  # recorded in this process, so the same machine description
    card = (jsonl / "README.md").read_text()
    assert "[None]" not in card and f"a local model (`{name}`)" in card
    # the data and the rewards that trained it; a quick start that loads the saved model (before: model="None")
    assert "Trained on the local dataset `prompts.jsonl`." in card and "huggingface.co/datasets" not in card
    assert "| `correctness` | 1 |" in card
    assert f'model="outputs/topr-{name}-prompts-jsonl"' in card and 'model="None"' not in card


def test_help_texts_say_what_the_flags_do(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help-all"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    block = text[text.index("--no_gradient_checkpointing, ") :].split("\n  --")[0]
    assert "Turn off gradient_checkpointing" in block and "Enable" not in block
    assert "outputs/topr-<model>-<data>" in cli.__doc__ and "outputs/<command>" not in cli.__doc__


def test_no_deepspeed_accelerator_warning_on_a_command(tmp_path):
    for argv in (["train", "--help"], ["train", "--dry_run", "true"]):
        completed = run_cli(argv, tmp_path)
        assert completed.returncode == 0, completed.stderr[-2000:]
        assert "Setting accelerator to CPU" not in completed.stdout + completed.stderr


def test_a_locally_built_model_shows_its_progress_and_is_keyed_on_the_machine(tmp_path, capsys):
    """Settings that are not shipped are trained here, with progress, under a key naming torch, kernels, threads."""
    import torch

    from topr_trl.tasks.loading import builtin_model
    from topr_trl.tasks.tiny import machine_key

    options = TaskArguments(base_model_dir=str(tmp_path), warm_start_accuracy=0.0)
    folder = Path(builtin_model("arithmetic", options, seed=0))
    out = capsys.readouterr().out
    assert "warm start step 2/3000" in out and "building the built-in tiny model" in out  # the target stops it at 2
    assert folder.name.endswith(machine_key()) and f"t{torch.get_num_threads()}" in folder.name
    build = json.loads((folder / "build.json").read_text())
    assert build["machine"]["threads"] == torch.get_num_threads() and build["settings"]["target_accuracy"] == 0.0


# ----------------------------------------------------------------------------------------- evaluation rows
QUICK_SAMPLES = 4  # one step of QUICK: per_device_train_batch_size completions


def test_evaluation_reads_the_held_out_split_and_never_the_training_rows(user_dir, tiny_model_path):
    """`--eval_strategy steps` on a single data file (which holds the training split only) or on a folder whose test
    split repeats the training prompts is refused in one line before any model loads: it would report training rows
    as eval. With train.jsonl and test.jsonl, the evaluation reads the test split's prompts, and only they are added
    to what the reward function saw."""
    data = prompt_dataset()
    data.to_json(user_dir / "prompts.jsonl")
    (user_dir / "same").mkdir()
    data.to_json(user_dir / "same" / "train.jsonl")
    data.to_json(user_dir / "same" / "test.jsonl")
    (user_dir / "split").mkdir()
    train_rows, test_rows = data.select(range(4)), data.select(range(4, len(data)))
    train_rows.to_json(user_dir / "split" / "train.jsonl")
    test_rows.to_json(user_dir / "split" / "test.jsonl")
    common = [
        "train",
        "--model_name_or_path",
        tiny_model_path,
        "--reward_funcs",
        "my_rewards:correctness",
        *QUICK,
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "1",
        "--per_device_eval_batch_size",
        "4",
    ]
    for source, why, dry in (
        ("prompts.jsonl", "holds one split", ["--dry_run", "true"]),
        ("prompts.jsonl", "holds one split", []),
        ("same", "holds the training prompts themselves", []),
    ):
        with pytest.raises(SystemExit) as stop:
            main(common + ["--dataset_name", source, "--output_dir", f"out-{source}", *dry])
        message = one_line_error(stop)
        assert "--eval_strategy" in message and "--dataset_test_split" in message and why in message, message
    assert not (user_dir / "seen.jsonl").exists()

    main(common + ["--dataset_name", "split", "--output_dir", "out-split"])
    seen = [prompt for line in (user_dir / "seen.jsonl").read_text().splitlines() for prompt in json.loads(line)]
    trained, evaluated = seen[:QUICK_SAMPLES], seen[QUICK_SAMPLES:]  # one training step's samples, then the eval's
    assert set(trained) <= set(train_rows["prompt"])
    assert set(evaluated) == set(test_rows["prompt"])


# ----------------------------------------------------------------------------------------- one line, not a traceback
def test_what_would_fail_far_into_a_run_is_refused_in_one_line_before_it(user_dir, tiny_model_path):
    """A model folder without a tokenizer (transformers builds a one-token tokenizer from the config, and the run
    died with IndexError) or without weights, a conversational prompt without `role`, an --output_dir that is a file or lies under one,
    and another model's checkpoint of the same architecture: each one line, dry run or not where a dry run checks."""
    import shutil

    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    common = ["--dataset_name", "prompts.jsonl", "--reward_funcs", "my_rewards:correctness", *QUICK]
    untokenized = user_dir / "no-tokenizer"
    untokenized.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_path) / name, untokenized / name)
    for dry in (["--dry_run", "true"], []):
        with pytest.raises(SystemExit) as stop:
            main(["train", "--model_name_or_path", str(untokenized), *common, "--output_dir", "a", *dry])
        assert "has no tokenizer" in one_line_error(stop)
    # a folder with its config and tokenizer but no weights (transformers' OSError at loading; the dry run passed it)
    weightless = user_dir / "no-weights"
    shutil.copytree(tiny_model_path, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    generate = ["generate", "--dataset_name", "prompts.jsonl", "--reward_funcs", "my_rewards:correctness"]
    for command in (["train", *common, "--output_dir", "w"], [*generate, "--output_dir", "g"]):
        for dry in (["--dry_run", "true"], []):
            with pytest.raises(SystemExit) as stop:
                main([*command[:1], "--model_name_or_path", str(weightless), *command[1:], *dry])
            message = one_line_error(stop)
            assert f"{weightless} has no weights (none of model.safetensors" in message, message

    (user_dir / "roleless.jsonl").write_text(json.dumps({"prompt": [{"content": "1+1="}], "answer": "2"}) + "\n")
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "train",
                "--model_name_or_path",
                tiny_model_path,
                *common[2:],
                "--dataset_name",
                "roleless.jsonl",
                "--output_dir",
                "b",
            ]
        )
    assert "prompt row 0: every message of a conversational prompt needs `role` and `content`" in one_line_error(stop)

    (user_dir / "a-file").write_text("")
    for output_dir, says in (("a-file", "is a file"), ("a-file/run", "lies under a-file, which is a file")):
        with pytest.raises(SystemExit) as stop:
            main(["train", "--model_name_or_path", tiny_model_path, *common, "--output_dir", output_dir])
        assert f"--output_dir {output_dir} {says}" in one_line_error(stop)
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "generate",
                *user_data_flags(tiny_model_path, "prompts.jsonl"),
                "--max_completion_length",
                "4",
                "--output_dir",
                "a-file",
            ]
        )
    assert "--output_dir a-file is a file" in one_line_error(stop)

    other = user_dir / "wider"  # the same architecture (Qwen2), another size
    from topr_trl.tasks.tiny import build_model, build_tokenizer, save_pretrained

    save_pretrained(build_model(build_tokenizer(), seed=1, hidden_size=48), build_tokenizer(), other)
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "train",
                "--model_name_or_path",
                tiny_model_path,
                *common,
                "--output_dir",
                "c",
                "--resume_from_checkpoint",
                str(other),
            ]
        )
    message = one_line_error(stop)
    assert "does not fit this model" in message and "there and" in message


def test_a_folder_a_live_run_holds_says_so_before_anything_else(user_dir, tiny_model_path):
    """The folder holds an interrupted run's checkpoint and a live run's lock: the second run is told the folder is
    in use (resuming into a live run is no way out), not to pass --resume_from_checkpoint."""
    import fcntl

    from topr_trl.commands.output_folders import LOCK_FILE

    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    (user_dir / "live" / "checkpoint-1").mkdir(parents=True)
    (user_dir / "live" / "checkpoint-1" / "trainer_state.json").write_text("{}")
    with open(user_dir / "live" / LOCK_FILE, "w") as held:
        held.write("pid 12345 on this machine\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SystemExit) as stop:
            main(
                [
                    "train",
                    *user_data_flags(tiny_model_path, "prompts.jsonl"),
                    *QUICK,
                    "--output_dir",
                    "live",
                ]
            )
    message = one_line_error(stop)
    assert "is in use by another run (pid 12345 on this machine)" in message and "resume" not in message


def test_the_printed_resume_command_is_the_one_the_user_ran(user_dir, monkeypatch):
    """scripts/train.sh's user gets the script back (`topr-trl` is not on their PATH); a console script that is not
    the one on the PATH is given by its path."""
    from topr_trl.commands.arguments import Invocation
    from topr_trl.commands.interruption import interrupted_run

    (user_dir / "run" / "checkpoint-3").mkdir(parents=True)
    (user_dir / "run" / "checkpoint-3" / "trainer_state.json").write_text("{}")
    monkeypatch.setenv(cli.LAUNCHER_ENV, "bash /opt/my\\ repo/scripts/train.sh")
    stop = interrupted_run("run", Invocation(launcher=tuple(cli.command_line("train")), arguments=("--max_steps", "9")))
    assert stop.code == 130
    assert cli.command_line("train") == ["bash", "/opt/my repo/scripts/train.sh"]
    monkeypatch.delenv(cli.LAUNCHER_ENV)
    monkeypatch.setattr(sys, "argv", [str(user_dir / "venv" / "bin" / "topr-trl")])
    monkeypatch.setenv("PATH", str(user_dir / "nowhere"))
    assert cli.command_line("train") == ["venv/bin/topr-trl", "train"]


# ----------------------------------------------------------------------------------------- weighted rewards
def test_weighted_rewards_work_the_same_in_generate_and_asynchronous_train(user_dir, tiny_model_path):
    """`generate --reward_weights` stores the weighted sum and records the weights (before, generate had no such flag
    and recorded 1.0 each); `train --asynchronous` takes them (before, refused); and `generate` into a folder that
    holds a trained model, not a generation, is refused in one line instead of writing shards beside it."""
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    rewards = ["--reward_funcs", "my_rewards:correctness", "my_rewards:correctness", "--reward_weights", "1", "0.5"]
    model_data = ["--model_name_or_path", tiny_model_path, "--dataset_name", "prompts.jsonl", *rewards]
    generate = ["generate", *model_data, "--num_generations", "4", "--max_prompts", "2", "--max_completion_length", "4"]
    main([*generate, "--output_dir", "data"])
    manifest = json.loads((user_dir / "data" / "manifest.json").read_text())
    assert manifest["settings"]["reward_weights"] == [1.0, 0.5]
    from topr_trl.offline import load_offline_dataset

    assert set(load_offline_dataset(user_dir / "data")["reward"]) <= {1.5, -1.5}

    main(
        [
            "train",
            *model_data,
            *QUICK,
            "--asynchronous",
            "true",
            "--output_dir",
            "asynchronous",
        ]
    )
    assert json.loads((user_dir / "asynchronous" / "topr_summary.json").read_text())["steps"] == 1
    state = json.loads((user_dir / "asynchronous" / "trainer_state.json").read_text())
    logged = [entry["reward"] for entry in state["log_history"] if "reward" in entry]
    assert logged and all(abs(value) == 1.5 for value in logged)

    with pytest.raises(SystemExit) as stop:
        main([*generate, "--output_dir", "asynchronous"])
    assert "holds other files" in one_line_error(stop) and not any((user_dir / "asynchronous").glob("shard-*"))


def test_chat_prompts_for_a_model_without_a_chat_template_are_refused_naming_the_way_out(user_dir, tiny_model_path):
    """Conversational prompts and a model whose tokenizer has no chat template: one line, in the dry run and in the
    run, before any weight loads, saying to give plain-text prompts or a model with a template (transformers said
    "Cannot use chat template functions" after loading, and the dry run called it valid). Plain text still trains."""
    import shutil

    untemplated = user_dir / "untemplated"
    shutil.copytree(tiny_model_path, untemplated)
    config = json.loads((untemplated / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (untemplated / "tokenizer_config.json").write_text(json.dumps(config))
    (untemplated / "chat_template.jinja").unlink(missing_ok=True)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in range(4)]
    (user_dir / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["train", "--model_name_or_path", str(untemplated), "--reward_funcs", "my_rewards:correctness", *QUICK]
    for dry in (["--dry_run", "true"], []):
        with pytest.raises(SystemExit) as stop:
            main([*common, "--dataset_name", "chats.jsonl", "--output_dir", "chats", *dry])
        message = one_line_error(stop)
        assert "prompt row 0 is a conversation" in message and "plain text" in message, message
    prompt_dataset().to_json(user_dir / "plain.jsonl")
    main([*common, "--dataset_name", "plain.jsonl", "--output_dir", "plain"])
    assert (user_dir / "plain" / "model.safetensors").is_file()
