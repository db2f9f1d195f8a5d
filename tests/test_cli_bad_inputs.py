"""Bad inputs a user meets on the command line fail at once, in one line starting `topr-trl:` that names their own
flag, YAML key or file (and line) and says what to change: YAML scalars and lists, unreadable or empty data files,
reward modules given as paths, negative numbers and values the run would refuse only later."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from topr_trl.commands import arguments
from topr_trl.commands.cli import main
from topr_trl.config import TOPRConfig

from .conftest import REWARD_MODULE, cli_refusal
from .test_cli_user_path import QUICK, prompt_dataset


ROOT = Path(__file__).resolve().parents[1]


def custom_run(model: str, *flags: str, data: str = "prompts.jsonl") -> list[str]:
    return ["train", "--model_name_or_path", model, "--dataset_name", data, *flags]


def data_file_refusal(model: str, name: str, dry_run: bool) -> str:
    """The one line a quick run of `model` on the data file `name` (with the user's reward, `--dry_run` or not)
    stops with."""
    return cli_refusal(
        custom_run(
            model, "--reward_funcs", "my_rewards:correctness", *QUICK, "--dry_run", str(dry_run).lower(), data=name
        )
    )


def run_as_a_user(argv: list[str], cwd: Path) -> str:
    """`python -m topr_trl ARGV` from the user's folder: it must fail with exactly one `topr-trl:` line on stderr
    and no traceback; returns that line."""
    completed = subprocess.run(
        [sys.executable, "-m", "topr_trl", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SEEN_PROMPTS": str(cwd / "seen.jsonl")},
    )
    lines = [line for line in completed.stderr.splitlines() if line.startswith("topr-trl:")]
    assert completed.returncode == 1 and "Traceback" not in completed.stderr, completed.stderr[-2000:]
    assert len(lines) == 1, completed.stderr[-2000:]
    return lines[0]


# ----------------------------------------------------------------------------- 4: YAML scalars and lists
def readme_reward_recipe() -> str:
    """The YAML example of the README's section on the user's own model, data and reward."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your own model, data and reward", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def test_readme_recipe_with_one_reward_function_as_a_yaml_string(user_dir, tiny_model_path, capsys):
    recipe = readme_reward_recipe()
    assert re.search(r"^ *reward_funcs: my_rewards:correctness", recipe, re.M)
    model = re.search(r"model_name_or_path: (\S+)", recipe).group(1)
    (user_dir / "data").mkdir()
    prompt_dataset().to_json(user_dir / "data" / "prompts.jsonl")
    (user_dir / "run.yaml").write_text(recipe.replace(model, tiny_model_path))
    main(["train", "--config", "run.yaml", "--dry_run", "true"])
    assert "rewards=['correctness']" in capsys.readouterr().out
    script_args, training_args, _ = arguments.parse_command("train", ["--config", "run.yaml"])
    assert script_args.reward_funcs == ["my_rewards:correctness"] and training_args.reward_weights is None


def test_yaml_scalar_for_reward_weights_is_one_weight(user_dir, tiny_model_path):
    (user_dir / "run.yaml").write_text("reward_funcs: my_rewards:correctness\nreward_weights: 0.5\n")
    _, training_args, _ = arguments.parse_command("train", custom_run(tiny_model_path, "--config", "run.yaml")[1:])
    assert training_args.reward_weights == [0.5]


def test_yaml_list_for_a_one_value_key_is_refused_naming_the_key_and_file(user_dir, tiny_model_path):
    (user_dir / "run.yaml").write_text("max_steps: [3]\n")
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    message = cli_refusal(
        custom_run(
            tiny_model_path, "--reward_funcs", "my_rewards:correctness", "--config", "run.yaml", "--dry_run", "true"
        )
    )
    assert "max_steps" in message and "run.yaml" in message and "`max_steps: 3`" in message


# ----------------------------------------------------------------------------- 5 and 6: data files
BAD_ROWS = '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+1=", answer: "2"}\n'


def test_data_file_not_utf8_fails_at_once_naming_the_file_and_line_as_a_user_runs_it(tmp_path, tiny_model_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    (tmp_path / "data" / "prompts.jsonl").write_bytes(
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+\xff=", "answer": "2"}\n'
    )
    line = run_as_a_user(
        custom_run(tiny_model_path, "--reward_funcs", "my_rewards:correctness", *QUICK, data="data/prompts.jsonl"),
        tmp_path,
    )
    assert "data/prompts.jsonl line 2" in line and "0xff" in line and "UTF-8" in line
    assert not (tmp_path / "seen.jsonl").exists()  # stopped before any step


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("prompts.jsonl", BAD_ROWS.encode(), "prompts.jsonl line 2: not valid JSON"),
        (
            "prompts.jsonl",
            b'{"prompt": "1+1=", "answer": "2"}\n["1+1=", "2"]\n',
            "prompts.jsonl line 2: not a JSON object",
        ),
        (
            "prompts.json",
            b'[\n {"prompt": "1+1=", "answer": "2"},\n {"prompt": "2+1=",}\n]\n',
            "prompts.json line 3: not valid JSON",
        ),
        (
            "prompts.csv",
            b"prompt,answer\n1+1=,2\n1+\xfe=,2\n",
            "prompts.csv line 3: byte 0xfe at column 3 is not UTF-8",
        ),
    ],
)
def test_unreadable_data_file_is_refused_naming_the_file_and_line(
    name, content, expected, dry_run, user_dir, tiny_model_path
):
    (user_dir / name).write_bytes(content)
    assert expected in data_file_refusal(tiny_model_path, name, dry_run)


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize(
    "name, write, expected",
    [
        ("prompts.jsonl", lambda path: path.write_bytes(b""), "prompts.jsonl: the file is empty (0 bytes)"),
        ("prompts.jsonl", lambda path: path.write_text("\n\n"), "prompts.jsonl: the file holds no rows"),
        ("prompts.csv", lambda path: path.write_text("prompt,answer\n"), "prompts.csv: the file holds no rows"),
        (
            "prompts.parquet",
            lambda path: Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(path)),
            "prompts.parquet: the file holds no rows",
        ),
    ],
)
def test_empty_data_file_is_refused_naming_the_file(name, write, expected, dry_run, user_dir, tiny_model_path):
    write(user_dir / name)
    assert expected in data_file_refusal(tiny_model_path, name, dry_run)


def test_empty_offline_dataset_file_is_refused_by_a_dry_run(user_dir):
    (user_dir / "stored.jsonl").write_bytes(b"")
    assert "stored.jsonl: the file is empty" in cli_refusal(
        ["train", "--offline_dataset", "stored.jsonl", "--dry_run", "true"]
    )


# ----------------------------------------------------------------------------- 7: reward modules as paths
def test_reward_module_path_without_the_py_suffix_is_the_module_file(user_dir, tiny_model_path, capsys):
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    main(custom_run(tiny_model_path, "--reward_funcs", "./my_rewards:correctness", "--dry_run", "true"))
    assert "rewards=['correctness']" in capsys.readouterr().out


@pytest.mark.parametrize(
    "location, problem",
    [
        ("./data/", "./data/ is a folder"),
        ("./data/prompts.jsonl", "./data/prompts.jsonl is not a Python file"),
        ("./nowhere", "no such file ./nowhere or ./nowhere.py"),
    ],
)
def test_reward_path_that_is_no_module_file_is_refused_naming_the_flag(location, problem, user_dir, tiny_model_path):
    (user_dir / "data").mkdir()
    prompt_dataset().to_json(user_dir / "data" / "prompts.jsonl")
    message = cli_refusal(
        custom_run(
            tiny_model_path, "--reward_funcs", f"{location}:correctness", "--dry_run", "true", data="data/prompts.jsonl"
        )
    )
    assert message.startswith(f"topr-trl: --reward_funcs {location}:correctness: {problem}")
    assert "path/to/file.py:function" in message


# ----------------------------------------------------------------------------- 10: numbers and later refusals
def test_negative_numbers_are_values(tiny_model_path):
    _, training_args, _ = arguments.parse_command(
        "train",
        custom_run(tiny_model_path, "--topr_signal", "reward", "--topr_baseline", "-5e-1", "--epsilon", "2E-1")[1:],
    )
    assert training_args.topr_baseline == -0.5 and training_args.epsilon == 0.2


def test_negative_learning_rate_is_refused_naming_the_flag_as_a_user_runs_it(tmp_path):
    line = run_as_a_user(["train", "--learning_rate", "-1e-5", "--dry_run", "true"], tmp_path)
    assert line.startswith("topr-trl: --learning_rate must be >= 0, got -1e-05")


def test_num_generations_that_does_not_divide_the_batch_is_said_in_the_users_flags(user_dir, tiny_model_path):
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    message = cli_refusal(
        custom_run(
            tiny_model_path, "--reward_funcs", "my_rewards:correctness", "--num_generations", "3", "--dry_run", "true"
        )
    )
    assert "generation_batch_size" not in message
    assert message.startswith("topr-trl: --num_generations (3) must divide")
    assert "--per_device_train_batch_size (8) x processes (1) x --gradient_accumulation_steps (1) = 8" in message


@pytest.mark.parametrize(
    "flags, yaml, expected",
    [
        (["--learning_rate", "-1e-5"], None, "topr-trl: --learning_rate must be >= 0"),
        ([], "learning_rate: -1.0e-5\n", "topr-trl: learning_rate (set in run.yaml) must be >= 0"),
        (["--max_completion_length", "0"], None, "topr-trl: --max_completion_length must be at least 1"),
        ([], "max_steps: [3]\n", "topr-trl: max_steps: [3] in the config file run.yaml is a list"),
        (
            ["--reward_funcs", "my_rewards:correctness", "arithmetic", "--reward_weights", "1"],
            None,
            "topr-trl: --reward_weights gives 1 weight(s) for 2 reward function(s) (correctness, arithmetic_reward)",
        ),
        (
            [],
            "reward_funcs: [my_rewards:correctness, arithmetic]\nreward_weights: 1\n",
            "topr-trl: reward_weights (set in the config file) gives 1 weight(s) for 2 reward function(s)",
        ),
    ],
)
@pytest.mark.parametrize("dry_run", ["true", "false"])
def test_dry_run_refuses_what_the_run_would_refuse(flags, yaml, expected, dry_run, user_dir, tiny_model_path):
    """The same line, dry or not, and a real run refuses before any model loads or any folder is made."""
    prompt_dataset().to_json(user_dir / "prompts.jsonl")
    if yaml is not None:
        (user_dir / "run.yaml").write_text(yaml)
    reward = [] if "reward_funcs" in " ".join(flags) + (yaml or "") else ["--reward_funcs", "my_rewards:correctness"]
    config = ["--config", "run.yaml"] if yaml is not None else []
    message = cli_refusal(custom_run(tiny_model_path, *reward, *config, *flags, "--dry_run", dry_run))
    assert message.startswith(expected)
    assert not (user_dir / "outputs").exists()


def test_python_api_refuses_at_construction_what_training_would(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match=r"^`learning_rate` must be >= 0"):
        TOPRConfig(learning_rate=-1e-5, **common)
    with pytest.raises(ValueError, match=r"^`max_completion_length` must be at least 1"):
        TOPRConfig(max_completion_length=0, **common)
    with pytest.raises(
        ValueError,
        match=r"`per_device_train_batch_size` \(8\) x processes \(1\) x "
        r"`gradient_accumulation_steps` \(2\) = 16",
    ):
        TOPRConfig(num_generations=3, gradient_accumulation_steps=2, **common)
    # what GRPOConfig accepts stays accepted: a zero learning rate, no completion cap, a batch of whole groups
    TOPRConfig(learning_rate=0.0, max_completion_length=None, num_generations=4, **common)
