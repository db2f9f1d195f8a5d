"""`topr-trl generate` records what defines its data (model and weights, prompts, reward functions, sampling
settings) and refuses, in one line naming the change, to resume a folder generated with anything else; the same
settings resume, and --overwrite_output_dir true generates again."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl.commands.cli import main
from topr_trl.offline import generate_offline_dataset, load_offline_dataset
from topr_trl.offline.generation import GeneratedWithOtherSettings

from .conftest import SHARED, cli_refusal, parity_reward
from .launching import user_data_flags


MAKE_USER_FOLDER = SHARED / "tools" / "user_folder" / "make_user_folder.py"
OTHER_REWARDS = '''def length_parity(completions, **kwargs):
    """+1 for a completion of even length, -1 otherwise."""
    return [1.0 if len(str(c)) % 2 == 0 else -1.0 for c in completions]
'''


def make_user_folder(folder: Path, seed: int = 0) -> Path:
    subprocess.run(
        [sys.executable, str(MAKE_USER_FOLDER), str(folder), "--seed", str(seed)], check=True, capture_output=True
    )
    return folder


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's folder: their model (my-model), data/ and my_rewards.py, plus a second model (other-model, other
    weights) and a second reward module."""
    if not MAKE_USER_FOLDER.is_file():
        pytest.skip(f"{MAKE_USER_FOLDER} is absent (../shared is not beside the checkout)")
    folder = make_user_folder(tmp_path_factory.mktemp("user"))
    other = make_user_folder(tmp_path_factory.mktemp("other-user"), seed=1)
    shutil.copytree(other / "my-model", folder / "other-model")
    (folder / "other_rewards.py").write_text(OTHER_REWARDS)
    return folder


def generate_argv(user: Path, output_dir: Path, *changes: str) -> list[str]:
    """`topr-trl generate` on the user's model, prompts and reward: 4 prompts x 2 completions of 4 tokens, in 2
    shards; `changes` are flags given on top (a later flag wins)."""
    return [
        "generate",
        "--model_name_or_path",
        str(user / "my-model"),
        "--dataset_name",
        str(user / "data" / "prompts.jsonl"),
        "--reward_funcs",
        f"{user / 'my_rewards.py'}:correctness",
        "--max_prompts",
        "4",
        "--num_generations",
        "2",
        "--max_completion_length",
        "4",
        "--prompts_per_shard",
        "2",
        "--backend",
        "transformers",
        "--output_dir",
        str(output_dir),
        *changes,
    ]


@pytest.fixture(scope="module")
def generated(user, tmp_path_factory) -> Path:
    """A finished generation (the user's settings); tests change copies of it."""
    folder = tmp_path_factory.mktemp("generated") / "data"
    main(generate_argv(user, folder))
    return folder


def same_rows(first, second) -> bool:
    """Row for row equal, an unscored reward (NaN) equal to itself."""
    return json.dumps(first.to_list()) == json.dumps(second.to_list())


def shard_times(folder: Path) -> dict[str, int]:
    return {shard.name: shard.stat().st_mtime_ns for shard in sorted(folder.glob("shard-*"))}


def test_the_manifest_records_what_defines_the_data(user, generated):
    settings = json.loads((generated / "manifest.json").read_text())["settings"]
    assert settings["model"]["name_or_path"] == str((user / "my-model").resolve())
    assert settings["model"]["weights"].startswith("files sha256:") and settings["model"]["revision"] is None
    assert settings["dataset"]["name"] == str((user / "data" / "prompts.jsonl").resolve())
    assert settings["dataset"]["num_prompts"] == 4 and len(settings["dataset"]["rows_sha256"]) == 64
    assert settings["reward_funcs"] == ["correctness"] and settings["reward_weights"] == [1.0]
    assert {
        key: settings[key]
        for key in (
            "num_completions",
            "temperature",
            "top_p",
            "top_k",
            "max_new_tokens",
            "backend",
            "seed",
            "chat_template_kwargs",
            "prompts_per_shard",
        )
    } == dict(
        num_completions=2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=4,
        backend="transformers",
        seed=0,
        chat_template_kwargs={},
        prompts_per_shard=2,
    )


@pytest.mark.parametrize(
    "changes, named",
    [
        (["--model_name_or_path", "{user}/other-model"], "--model_name_or_path {user}/my-model -> {user}/other-model"),
        (
            ["--dataset_name", "{user}/data/chat.jsonl"],
            "--dataset_name {user}/data/prompts.jsonl -> {user}/data/chat.jsonl",
        ),
        (["--max_prompts", "3"], "the number of prompts (--max_prompts) 4 -> 3"),
        (
            ["--reward_funcs", "{user}/other_rewards.py:length_parity"],
            '--reward_funcs ["correctness"] -> ["length_parity"]',
        ),
        (
            ["--reward_funcs", "{user}/my_rewards.py:correctness", "{user}/other_rewards.py:length_parity"],
            '--reward_funcs ["correctness"] -> ["correctness", "length_parity"]',
        ),
        (["--temperature", "0.7"], "--temperature 1.0 -> 0.7"),
        (["--top_p", "0.9"], "--top_p 1.0 -> 0.9"),
        (["--top_k", "5"], "--top_k 0 -> 5"),
        (["--max_completion_length", "5"], "--max_completion_length 4 -> 5"),
        (["--num_generations", "3"], "--num_generations 2 -> 3"),
        (["--backend", "vllm"], "--backend transformers -> vllm"),
        (["--seed", "1"], "--seed 0 -> 1"),
        (
            ["--chat_template_kwargs", '{"enable_thinking": false}'],
            '--chat_template_kwargs {} -> {"enable_thinking": false}',
        ),
        (["--prompts_per_shard", "4"], "--prompts_per_shard 2 -> 4"),
    ],
)
def test_a_rerun_with_anything_changed_is_refused_naming_it(changes, named, user, generated, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(generated, folder)
    before = shard_times(folder)
    resolved = str(user.resolve())
    message = cli_refusal(generate_argv(user, folder, *[change.replace("{user}", str(user)) for change in changes]))
    assert named.replace("{user}", resolved) in message
    assert "other settings" in message and message.count(" -> ") == 1  # the change, and nothing else
    assert "another --output_dir" in message and "--overwrite_output_dir true" in message
    assert shard_times(folder) == before and json.loads((folder / "manifest.json").read_text()) == json.loads(
        (generated / "manifest.json").read_text()
    )  # nothing touched


def test_changed_weights_or_prompts_under_the_same_names_are_refused(user, tmp_path):
    model, data = tmp_path / "model", tmp_path / "prompts.jsonl"
    shutil.copytree(user / "my-model", model)
    data.write_text((user / "data" / "prompts.jsonl").read_text())
    argv = generate_argv(user, tmp_path / "out", "--model_name_or_path", str(model), "--dataset_name", str(data))
    main(argv)
    trained = AutoModelForCausalLM.from_pretrained(model)  # as if a run had saved a new policy into the folder
    with torch.no_grad():
        trained.model.layers[0].self_attn.q_proj.weight.add_(0.01)
    trained.save_pretrained(model)
    message = cli_refusal(argv)
    assert f"--model_name_or_path {model}: its weights changed (files sha256:" in message
    shutil.copytree(user / "my-model", model, dirs_exist_ok=True)  # the original weights back: accepted again
    main(argv)
    rows = data.read_text().splitlines()
    data.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # the same file, its prompts reordered
    assert f"--dataset_name {data}: its prompt rows changed" in cli_refusal(argv)


def test_an_identical_rerun_resumes_and_keeps_the_rows(user, generated, tmp_path, capsys):
    folder = tmp_path / "data"
    shutil.copytree(generated, folder)
    rows = load_offline_dataset(generated)
    kept = shard_times(folder)
    main(generate_argv(user, folder))
    assert shard_times(folder) == kept  # nothing regenerated
    assert same_rows(load_offline_dataset(folder), rows)
    assert "generated 8 completions for 4 prompts" in capsys.readouterr().out
    shutil.rmtree(folder / "shard-00001")  # as if interrupted before the last shard
    main(generate_argv(user, folder))
    assert shard_times(folder)["shard-00000"] == kept["shard-00000"]
    resumed = load_offline_dataset(folder)
    assert same_rows(resumed.select(range(4)), rows.select(range(4)))  # the first shard kept
    assert sorted(zip(resumed["prompt_index"], resumed["sample_index"], strict=False)) == [
        (p, s) for p in range(4) for s in (0, 1)
    ]


def test_overwrite_output_dir_regenerates_with_the_new_model(user, generated, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(generated, folder)
    main(
        generate_argv(user, folder, "--model_name_or_path", str(user / "other-model"), "--overwrite_output_dir", "true")
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["settings"]["model"]["name_or_path"] == str((user / "other-model").resolve())
    fresh = tmp_path / "fresh"
    main(generate_argv(user, fresh, "--model_name_or_path", str(user / "other-model")))
    overwritten, old = load_offline_dataset(folder), load_offline_dataset(generated)
    assert overwritten["completion_ids"] == load_offline_dataset(fresh)["completion_ids"]  # the new model's rows
    assert overwritten["behaviour_logps"] != old["behaviour_logps"]
    main(generate_argv(user, folder, "--model_name_or_path", str(user / "other-model")))  # and now it resumes


def test_the_same_model_and_prompts_moved_elsewhere_resume(user, generated, tmp_path, capsys):
    """What defines the data is the weights and the prompt rows, not where they lie: a copied model folder and a
    copied data file resume the generation (an edited copy is refused, by the tests above)."""
    folder = tmp_path / "data"
    shutil.copytree(generated, folder)
    shutil.copytree(user / "my-model", tmp_path / "moved-model")
    shutil.copy(user / "data" / "prompts.jsonl", tmp_path / "moved.jsonl")
    main(
        generate_argv(
            user,
            folder,
            "--model_name_or_path",
            str(tmp_path / "moved-model"),
            "--dataset_name",
            str(tmp_path / "moved.jsonl"),
        )
    )
    assert "generated 8 completions for 4 prompts" in capsys.readouterr().out
    assert load_offline_dataset(folder)["completion_ids"] == load_offline_dataset(generated)["completion_ids"]


@pytest.mark.parametrize("state", ["older manifest", "no manifest", "unreadable manifest"])
def test_a_generation_whose_manifest_cannot_be_checked_is_refused(state, user, generated, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(generated, folder)
    manifest = folder / "manifest.json"
    if state == "older manifest":  # what topr-trl wrote before it recorded the model and the prompts
        manifest.write_text(
            json.dumps(
                {
                    "settings": {
                        "num_prompts": 4,
                        "num_completions": 2,
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "top_k": 0,
                        "max_new_tokens": 4,
                        "prompts_per_shard": 2,
                        "reward_funcs": ["correctness"],
                    }
                }
            )
        )
    elif state == "no manifest":
        manifest.unlink()
    else:
        manifest.write_text('{"format": 2, "sett')
    message = cli_refusal(generate_argv(user, folder))
    assert "cannot be checked" in message and "--overwrite_output_dir true to delete it and generate again" in message
    main(generate_argv(user, folder, "--overwrite_output_dir", "true"))
    assert load_offline_dataset(folder)["completion_ids"] == load_offline_dataset(generated)["completion_ids"]


def test_a_user_running_from_their_folder_gets_one_line(user, tmp_path):
    """As a user runs it: `python -m topr_trl` from their own folder, their model, data and reward module by
    relative names; then the same command with another model."""
    command = [
        sys.executable,
        "-m",
        "topr_trl",
        "generate",
        *user_data_flags("my-model", "data/prompts.jsonl"),
        "--max_prompts",
        "2",
        "--num_generations",
        "2",
        "--max_completion_length",
        "3",
        "--backend",
        "transformers",
        "--output_dir",
        str(tmp_path / "data"),
    ]
    first = subprocess.run(command, cwd=user, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "generated 4 completions for 2 prompts" in first.stdout
    command[command.index("my-model")] = "other-model"
    second = subprocess.run(command, cwd=user, capture_output=True, text=True)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    lines = [line for line in second.stderr.splitlines() if line.startswith("topr-trl:")]
    assert len(lines) == 1, second.stderr
    assert f"--model_name_or_path {user.resolve()}/my-model -> {user.resolve()}/other-model" in lines[0]
    assert "--overwrite_output_dir true" in lines[0]


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)


def test_python_api_names_its_arguments_and_sees_weights_changed_in_memory(tiny, arithmetic_dataset, tmp_path):
    model, tokenizer = tiny
    prompts = arithmetic_dataset.select(range(2))
    settings = dict(num_completions=2, max_new_tokens=3, show_progress=False)
    generate_offline_dataset(model, tokenizer, prompts, parity_reward, tmp_path, **settings)
    with pytest.raises(
        GeneratedWithOtherSettings,
        match=r"num_completions 2 -> 3; max_new_tokens 3 -> 2\).*"
        r"overwrite=True",
    ):
        generate_offline_dataset(
            model,
            tokenizer,
            prompts,
            parity_reward,
            tmp_path,
            **{**settings, "num_completions": 3, "max_new_tokens": 2},
        )
    changed = AutoModelForCausalLM.from_pretrained(model.name_or_path)
    with torch.no_grad():
        changed.lm_head.weight.mul_(2)  # trained in memory, never saved: its files are those of `model`
    with pytest.raises(GeneratedWithOtherSettings, match="its weights changed"):
        generate_offline_dataset(changed, tokenizer, prompts, parity_reward, tmp_path, **settings)
    rows = generate_offline_dataset(changed, tokenizer, prompts, parity_reward, tmp_path, overwrite=True, **settings)
    assert len(rows) == 4


def test_iterate_refuses_an_iteration_generated_with_other_settings(tiny_model_path, arithmetic_dataset, tmp_path):
    from topr_trl.commands.iterations import IterationSettings, run_iterations

    prompts = arithmetic_dataset.select(range(2))
    generate_offline_dataset(
        tiny_model_path,
        AutoTokenizer.from_pretrained(tiny_model_path),
        prompts,
        parity_reward,
        tmp_path / "iteration-000" / "data",
        num_completions=2,
        max_new_tokens=3,
        temperature=0.5,
        backend="transformers",
        show_progress=False,
    )
    settings = IterationSettings(num_iterations=1, num_completions=2, max_new_tokens=3, backend="transformers")
    folder = re.escape(str(tmp_path / "iteration-000"))
    with pytest.raises(
        GeneratedWithOtherSettings, match=rf"temperature 0.5 -> 1.0\).*delete {folder} to redo iteration 0"
    ):
        run_iterations(tiny_model_path, prompts, parity_reward, tmp_path, settings)


def test_a_hub_model_is_recorded_by_the_commit_it_resolves_to(monkeypatch):
    import huggingface_hub

    from topr_trl.offline.generation import model_identity

    def cached(repo_id, filename, **kwargs):
        if filename != "adapter_config.json":
            raise huggingface_hub.errors.EntryNotFoundError(f"{repo_id} has no {filename}")
        return f"/cache/models--me--adapter/snapshots/0123abc/{filename}"

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cached)
    assert model_identity("me/adapter", {}) == {"name_or_path": "me/adapter", "revision": "0123abc", "weights": None}

    def offline(repo_id, filename, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache and the Hub is offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ValueError, match="cannot tell which revision of the model 'me/absent'"):
        model_identity("me/absent", {})


def test_training_on_a_generation_that_stopped_before_its_first_shard_says_to_rerun_it(user, tmp_path):
    """A `generate` whose reward function fails at the first shard leaves its manifest and no shard: `train
    --offline_dataset` on that folder says in one line to rerun the generation, instead of reading the manifest as
    rows (`ArrowInvalid: JSON parse error`)."""
    (tmp_path / "failing_rewards.py").write_text("def broken(completions, **kwargs):\n    raise RuntimeError('down')\n")
    folder = tmp_path / "data"
    with pytest.raises(SystemExit):
        main(generate_argv(user, folder, "--reward_funcs", f"{tmp_path / 'failing_rewards.py'}:broken"))
    assert (folder / "manifest.json").is_file() and not list(folder.glob("shard-*"))
    line = cli_refusal(
        [
            "train",
            "--model_name_or_path",
            str(user / "my-model"),
            "--offline_dataset",
            str(folder),
            "--output_dir",
            str(tmp_path / "run"),
        ]
    )
    assert "holds no complete shard yet" in line and "rerun the same generate command" in line, line


def test_a_model_whose_tokenizer_has_no_pad_token_generates_and_trains_offline(user, tmp_path):
    """`generate` pads with EOS where the tokenizer has no pad token, as `train` (GRPOTrainer) does: the offline path
    is open to such a model (it stopped with transformers' `tokenizer.pad_token = ...` advice), and the completions are
    the ones the model samples with a pad token set to EOS."""
    model = AutoModelForCausalLM.from_pretrained(user / "my-model")
    tokenizer = AutoTokenizer.from_pretrained(user / "my-model")
    tokenizer.pad_token = None
    unpadded = tmp_path / "unpadded"
    model.save_pretrained(unpadded)
    tokenizer.save_pretrained(unpadded)
    assert AutoTokenizer.from_pretrained(unpadded).pad_token_id is None
    argv = [*generate_argv(user, tmp_path / "data"), "--model_name_or_path", str(unpadded)]
    main(argv)
    rows = load_offline_dataset(tmp_path / "data")
    assert len(rows) == 4 * 2
    with_pad = tmp_path / "with-pad"
    tokenizer.pad_token = tokenizer.eos_token
    model.save_pretrained(with_pad)
    tokenizer.save_pretrained(with_pad)
    main([*generate_argv(user, tmp_path / "data-with-pad"), "--model_name_or_path", str(with_pad)])
    assert rows["completion_ids"] == load_offline_dataset(tmp_path / "data-with-pad")["completion_ids"]
    main(
        [
            "train",
            "--model_name_or_path",
            str(unpadded),
            "--offline_dataset",
            str(tmp_path / "data"),
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "2",
            "--max_completion_length",
            "4",
            "--topr_unscored_batch",
            "train",
            "--output_dir",
            str(tmp_path / "run"),
        ]
    )
    assert (tmp_path / "run" / "model.safetensors").is_file()
