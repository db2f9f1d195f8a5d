"""The main job's command line, on tiny settings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from topr_trl.commands.cli import main, run_command
from topr_trl.offline import load_offline_dataset
from topr_trl.tasks.arithmetic import arithmetic_reward
from topr_trl.tasks.user_rewards import resolve_reward

from .conftest import saved_model_accuracy
from .launching import builtin_generate_flags, builtin_run_flags


def main_generate(argv: list[str]) -> dict:
    return run_command("generate", argv)


def main_iterate(argv: list[str]) -> list[dict]:
    return run_command("iterate", argv)


def test_train_command_runs_the_builtin_job(tmp_path):
    output = tmp_path / "run"
    main(
        [
            "train",
            *builtin_run_flags(
                tmp_path / "base", max_steps=2, output_dir=output, per_device_train_batch_size=4, num_generations=4
            ),
        ]
    )
    summary = json.loads((output / "topr_summary.json").read_text())
    assert {"before", "after"} <= set(summary)
    base = Path(summary["model"])  # the built-in model, keyed under --base_model_dir
    assert base.parent == tmp_path / "base" and (base / "config.json").exists()
    # what the run reports is what its base and its saved model score, recomputed here
    assert summary["before"] == saved_model_accuracy(base, 8)
    assert summary["after"] == saved_model_accuracy(output, 8)
    assert (output / "model.safetensors").exists()


def test_unknown_flag_is_rejected(tmp_path):
    with pytest.raises(SystemExit, match="Did you mean --loss_type"):
        main(["train", "--loss_typee", "sft", "--output_dir", str(tmp_path)])


def test_module_entry_point_without_command_prints_usage():
    completed = subprocess.run([sys.executable, "-m", "topr_trl"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "topr-trl train" in completed.stdout


def test_reward_resolution():
    assert resolve_reward("arithmetic") is arithmetic_reward
    assert resolve_reward("topr_trl.tasks.arithmetic:arithmetic_reward") is arithmetic_reward
    with pytest.raises(ValueError, match="arithmetic"):
        resolve_reward("nonexistent")
    with pytest.raises(ValueError, match="no function 'arithmetic_rewardd'; did you mean 'arithmetic_reward'"):
        resolve_reward("topr_trl.tasks.arithmetic:arithmetic_rewardd")


def test_iterate_command_runs_offline_iterations(tmp_path):
    summaries = main_iterate(
        [
            "--iterations",
            "1",
            *builtin_run_flags(
                tmp_path / "base",
                4,
                4,
                num_generations=4,
                per_device_train_batch_size=8,
                output_dir=tmp_path / "iterations",
            ),
        ]
    )
    assert len(summaries) == 1 and summaries[0]["rows"] == 16 and "evaluation" in summaries[0]
    assert (tmp_path / "iterations" / "iteration-000" / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_one_offline_iteration_raises_accuracy_on_the_builtin_task(tmp_path):
    """Algorithm 1 on the built-in task with the command's defaults (warm start to 30 %, 256 prompts x 8)."""
    (summary,) = main_iterate(["--base_model_dir", str(tmp_path / "base"), "--output_dir", str(tmp_path / "it")])
    before, after = summary["evaluation_before"]["accuracy"], summary["evaluation"]["accuracy"]
    print(f"offline TOPR, one iteration: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after >= before + 0.05


def test_evaluate_command_is_wired(tiny_model_path, tmp_path):
    main(
        [
            "evaluate",
            "--model",
            tiny_model_path,
            "--k",
            "2",
            "--limit",
            "2",
            "--max_new_tokens",
            "4",
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "pass@1" in json.dumps(results)
    assert (tmp_path / "eval" / "results.png").exists()


def test_generate_then_train_offline_with_lora(tmp_path):
    """`topr-trl generate` writes an offline dataset; `topr-trl train --offline_dataset` trains a LoRA adapter on it
    (stored rewards, no generation), changing only adapter weights."""
    from safetensors.torch import load_file

    base = tmp_path / "base"
    summary = main_generate([*builtin_generate_flags(base), "--output_dir", str(tmp_path / "data")])
    assert summary["rows"] == 16
    data = load_offline_dataset(tmp_path / "data")
    assert summary["proportion_of_positives"] == sum(reward > 0 for reward in data["reward"]) / 16
    assert data["prompt_index"] == [i for i in range(4) for _ in range(4)]

    output = tmp_path / "run"
    main(
        [
            "train",
            "--offline_dataset",
            str(tmp_path / "data"),
            "--base_model_dir",
            str(base),
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--max_steps",
            "-1",
            "--task_eval_prompts",
            "4",
            "--learning_rate",
            "1e-2",
            "--topr_signal",
            "reward",
            "--use_peft",
            "true",
            "--lora_r",
            "4",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--output_dir",
            str(output),
        ]
    )
    adapter = load_file(output / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert any(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)  # B starts at 0
    assert not (output / "model.safetensors").exists()  # the base weights are not rewritten: only the adapter
    summary = json.loads((output / "topr_summary.json").read_text())
    assert Path(summary["model"]).parent == base
    assert summary["after"] == saved_model_accuracy(summary["model"], 4, adapter_dir=output)  # base + the adapter


def test_iterate_runs_from_the_offline_recipe(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "examples" / "recipes" / "offline_tiny_cpu.yaml"
    (summary,) = main_iterate(
        [
            "--config",
            str(recipe),
            *builtin_run_flags(tmp_path / "base", 4, 4, output_dir=tmp_path / "it", composition="anna_karenina"),
        ]
    )
    assert summary["composition"] == "anna_karenina" and summary["rows"] <= 32
    assert (tmp_path / "it" / "iteration-000" / "summary.json").exists()


@pytest.mark.parametrize(
    "command, flag, suggestion",
    [
        ("generate", "--num_generation", "--num_generations"),
        ("iterate", "--iteration", "--iterations"),
        ("iterate", "--compositon", "--composition"),
    ],
)
def test_subcommands_reject_misspelt_flags(command, flag, suggestion, tmp_path):
    with pytest.raises(SystemExit, match=f"Did you mean {suggestion}"):
        main([command, flag, "2", "--output_dir", str(tmp_path)])


def test_subcommands_dry_run_and_validate_choices(tmp_path, capsys):
    main(["generate", "--dry_run", "true", "--output_dir", str(tmp_path)])
    main(["iterate", "--dry_run", "true", "--output_dir", str(tmp_path)])
    assert capsys.readouterr().out.count("configuration valid") == 2
    assert not (tmp_path / "iteration-000").exists()
    with pytest.raises(SystemExit, match="Did you mean 'anna_karenina'"):
        main(["iterate", "--dry_run", "true", "--composition", "anna_karenin", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="Did you mean 'vllm'"):
        main(["generate", "--dry_run", "true", "--backend", "vlm", "--output_dir", str(tmp_path)])


def test_train_resumes_from_the_last_checkpoint(tmp_path):
    common = [
        "train",
        *builtin_run_flags(
            tmp_path / "base",
            16,
            4,
            output_dir=tmp_path / "run",
            per_device_train_batch_size=4,
            num_generations=4,
            save_strategy="steps",
            save_steps=1,
        ),
    ]
    main(common + ["--max_steps", "2"])
    second = tmp_path / "run" / "checkpoint-2" / "model.safetensors"
    written = second.stat().st_mtime_ns
    main(common + ["--max_steps", "3", "--resume_from_checkpoint", "true"])
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert second.stat().st_mtime_ns == written  # steps 1-2 were not trained (and saved) again


def test_missing_offline_dataset_is_reported(tmp_path):
    with pytest.raises(SystemExit, match="--offline_dataset .*nothing: no such file or folder"):
        main(
            [
                "train",
                "--offline_dataset",
                str(tmp_path / "nothing"),
                *builtin_run_flags(tmp_path / "base", 4, 4, output_dir=tmp_path / "run"),
            ]
        )


def test_every_builtin_recipe_key_is_a_field_of_its_command():
    """The built-in defaults live in YAML recipes: a misspelt key would silently not apply, so each must be a field."""
    import dataclasses

    from topr_trl.commands import arguments

    for command in ("train", "iterate", "generate"):
        fields = {f.name for kind in arguments.command_dataclasses(command) for f in dataclasses.fields(kind)}
        assert set(arguments.recipe(f"builtin-{command}")) <= fields, command
    train_fields = {f.name for kind in arguments.command_dataclasses("train") for f in dataclasses.fields(kind)}
    assert set(arguments.recipe("builtin-reasoning")) <= train_fields


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--max_steps", "1", "2"], "topr-trl: unexpected value '2'"),
        (["train", "--learning_rat", "1"], "topr-trl: unknown option --learning_rat. Did you mean --learning_rate?"),
        (["evaluate", "--model_name_or_path", "m", "--kk", "2"], "topr-trl: unknown option --kk. Did you mean --k?"),
    ],
)
def test_what_trls_parser_leaves_over_fails_in_one_line(argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert str(stop.value.code).startswith(message)
