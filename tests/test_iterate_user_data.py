"""`topr-trl iterate` on the user's own data measures each iteration before and after on the data's test split (the
mean reward of the user's reward functions on sampled completions), and says once, plainly, when there is none."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl.commands.cli import main
from topr_trl.offline.held_out import load_test_prompts, reward_evaluator
from topr_trl.tasks.loading import describe_accuracy

from .conftest import SHARED


SCORES = '''def length_parity(completions, **kwargs):
    """+1 for a completion of even length, -1 otherwise: every completion is scored."""
    return [1.0 if len(c if isinstance(c, str) else c[-1]["content"]) % 2 == 0 else -1.0 for c in completions]
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's folder: their model, 8 training and 3 test prompts as data/small/{train,test}.jsonl, the same 8
    training prompts alone in data/small.jsonl, and a reward module scores.py."""
    maker = SHARED / "tools" / "user_folder" / "make_user_folder.py"
    if not maker.is_file():
        pytest.skip(f"{maker} is absent (../shared is not beside the checkout)")
    folder = tmp_path_factory.mktemp("user")
    subprocess.run([sys.executable, str(maker), str(folder)], check=True, capture_output=True)
    rows = (folder / "data" / "prompts.jsonl").read_text().splitlines(keepends=True)
    (folder / "data" / "small").mkdir()
    (folder / "data" / "small" / "train.jsonl").write_text("".join(rows[:8]))
    (folder / "data" / "small" / "test.jsonl").write_text("".join(rows[200:203]))
    (folder / "data" / "small.jsonl").write_text("".join(rows[:8]))
    (folder / "scores.py").write_text(SCORES)
    return folder


def iterate(user: Path, dataset: str, output_dir: Path, monkeypatch, capsys, *extra: str) -> list[str]:
    """One iteration of `topr-trl iterate` run from the user's folder (`extra` flags on top); its `[topr-trl]` lines."""
    monkeypatch.chdir(user)
    main(
        [
            "iterate",
            "--model_name_or_path",
            "my-model",
            "--dataset_name",
            dataset,
            "--reward_funcs",
            "scores.py:length_parity",
            "--num_generations",
            "2",
            "--max_completion_length",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--iterations",
            "1",
            "--task_eval_prompts",
            "2",
            "--seed",
            "3",
            "--backend",
            "transformers",
            "--report_to",
            "none",
            "--output_dir",
            str(output_dir),
            *extra,
        ]
    )
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[topr-trl]")]


def test_iterations_draw_their_curves_one_after_another(user, tmp_path, monkeypatch, capsys):
    """The picture of an iterate run: every iteration's logged steps, each shifted by the steps before it, a
    boundary where each later iteration starts; the values are those each iteration's trainer logged."""
    from topr_trl.commands.iterations import iteration_curves

    lines = iterate(
        user, "data/small.jsonl", tmp_path / "run", monkeypatch, capsys, "--iterations", "2", "--logging_steps", "1"
    )
    assert "[topr-trl] curves of every iteration drawn to " + str(tmp_path / "run" / "curves.png") in lines
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    states = [
        json.loads((tmp_path / "run" / f"iteration-00{i}" / "train" / "trainer_state.json").read_text()) for i in (0, 1)
    ]
    curves, boundaries = iteration_curves(tmp_path / "run")
    first_steps = states[0]["global_step"]
    assert first_steps > 0 and boundaries == [first_steps]
    expected = [
        (entry["step"] + offset, entry["loss"])
        for state, offset in zip(states, (0, first_steps), strict=False)
        for entry in state["log_history"]
        if "loss" in entry
    ]
    assert (
        list(zip(*curves["loss"], strict=False)) == expected and len(expected) == first_steps + states[1]["global_step"]
    )


def test_iterations_on_data_with_a_test_split_are_measured_on_it(user, tmp_path, monkeypatch, capsys):
    lines = iterate(user, "data/small", tmp_path / "run", monkeypatch, capsys)
    assert (
        "[topr-trl] held-out measure: the first 2 prompts (--task_eval_prompts) of the 'test' split, scored by "
        "--reward_funcs" in lines
    )
    line = next(line for line in lines if line.startswith("[topr-trl] iteration 0: p="))
    how = "(sampled at temperature 1, 4 samples per prompt, at most 4 new tokens), on 2 held-out prompts"
    assert "; before: mean reward " in line and "; after: mean reward " in line and line.count(how) == 2, line
    assert not any("not measured" in line for line in lines)
    summary = json.loads((tmp_path / "run" / "iteration-000" / "summary.json").read_text())
    # recomputed apart from the run: the base model before, the saved policy after, on the first 2 test prompts
    test = Dataset.from_json(str(user / "data" / "small" / "test.jsonl")).select(range(2))
    reward = _user_reward(user)
    for model_dir, key in (
        (user / "my-model", "evaluation_before"),
        (tmp_path / "run" / "iteration-000" / "model", "evaluation"),
    ):
        evaluate = reward_evaluator(test, [reward], max_new_tokens=4, seed=3)
        expected = evaluate(AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir))
        assert summary[key] == expected, key


def _user_reward(user: Path):
    from topr_trl.tasks.user_rewards import resolve_reward

    return resolve_reward(f"{user / 'scores.py'}:length_parity")


def test_iterations_on_data_without_a_test_split_say_so_once(user, tmp_path, monkeypatch, capsys):
    lines = iterate(user, "data/small.jsonl", tmp_path / "run", monkeypatch, capsys)
    said = [line for line in lines if "no test split" in line]
    assert len(said) == 1 and "--dataset_test_split" in said[0] and "has no 'test' split" in said[0], lines
    assert not any("not measured" in line or "before:" in line for line in lines)
    assert any(line.startswith("[topr-trl] iteration 0: p=") for line in lines)


def test_reward_evaluator_reports_the_mean_reward_and_leaves_the_random_state_alone(tiny_model_path):
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoTokenizer.from_pretrained(tiny_model_path),
    )
    prompts = Dataset.from_list([{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(3)])
    calls = []

    def half(completions, answer, **kwargs):  # reads a dataset column, as GRPOTrainer passes them
        calls.append(list(answer))
        return [0.5] * len(completions)

    def unscorable(completions, **kwargs):
        return [None] * len(completions)

    state = torch.random.get_rng_state()
    result = reward_evaluator(prompts, [half], max_new_tokens=3)(model, tokenizer)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert result["mean_reward"] == 0.5 and result["positive_share"] == 1.0 and result["unscored_share"] == 0.0
    assert result["mean_reward_se"] == 0.0 and result["num_samples"] == 4 and result["num_problems"] == 3
    assert calls == [["0"] * 4 + ["2"] * 4 + ["4"] * 4]  # one call over all completions, each with its row
    assert describe_accuracy(result, 3) == (
        "mean reward 0.500 ± 0.000, reward > 0 on 1.000 (sampled at temperature "
        "1, 4 samples per prompt, at most 3 new tokens), on 3 held-out prompts"
    )
    nothing = reward_evaluator(prompts, [unscorable], max_new_tokens=3)(model, tokenizer)
    assert math.isnan(nothing["mean_reward"]) and nothing["unscored_share"] == 1.0
    weighted = reward_evaluator(prompts, [half, unscorable], reward_weights=[-2.0, 1.0], max_new_tokens=3)
    assert weighted(model, tokenizer)["mean_reward"] == -1.0


def test_a_test_split_is_only_a_held_out_one(user, tmp_path):
    train = Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}])
    train.save_to_disk(str(tmp_path / "saved"))  # one dataset: every split asked for is the training data
    assert load_test_prompts(str(tmp_path / "saved"), "test", "train", None, train)[1].endswith(
        "holds the training prompts themselves"
    )
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "train.jsonl").write_text('{"prompt": "a"}\n')
    held_out, why = load_test_prompts(str(tmp_path / "named"), "test", "train", None, train)
    assert held_out is None and "no 'test' split" in why
    held_out, why = load_test_prompts(str(user / "data" / "small"), "test", "train", None, train)
    assert why is None and len(held_out) == 3
