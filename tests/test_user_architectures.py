"""A user's own architectures through the command line, from their own folder (issue 54): a Pythia-family GPTNeoX
with its own output layer (stored as `embed_out`, held as `lm_head`) and an OPT with tied embeddings, each built by
the shared user-folder tool, outside the repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch

from topr_trl.commands.cli import main

from .conftest import SHARED, work_in
from .launching import SMALL_RUN, USER_FOLDER_DATA, as_flags


MAKER = SHARED / "tools" / "user_folder" / "make_user_folder.py"
ARCHITECTURES = {"gptneox": ["--arch", "gptneox", "--untied"], "opt": ["--arch", "opt"]}
# a reward of -1 for every completion and the signal R - 0: every sample pushes its tokens down, so one step moves
# every layer the completions reach, the output layer included
ONE_STEP = as_flags(
    **USER_FOLDER_DATA,
    **SMALL_RUN,
    topr_unscored_batch="train",
    topr_signal="reward",
    learning_rate="1e-2",
    max_steps=1,
    save_steps=1,
)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def architecture_folder(request, tmp_path_factory) -> Path:
    if not MAKER.is_file():
        pytest.skip(f"the shared user-folder tool is not beside the repository ({MAKER})")
    folder = tmp_path_factory.mktemp(request.param)
    subprocess.run(
        [sys.executable, str(MAKER), str(folder), *ARCHITECTURES[request.param]],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return folder


@pytest.fixture
def in_folder(architecture_folder, monkeypatch) -> Path:
    return work_in(architecture_folder, monkeypatch)


def stored(folder: Path) -> dict:
    return safetensors.torch.load_file(folder / "model.safetensors")


def test_resuming_restores_every_trained_weight(in_folder):
    """A two-step run with a checkpoint at each step, then a run resumed from its first checkpoint into another
    folder: the model it saves is the two-step run's, every weight of it, bit for bit. Before, GPTNeoX's output layer
    was stored as `embed_out`, not loaded back as `lm_head`, and the resumed run trained on from the base model's
    output layer. Resuming the finished run with nothing left to train is refused in one line and leaves its model as
    it was (it stepped past `max_steps` and overwrote the finished model)."""
    two_steps = ["--model_name_or_path", "my-model", *ONE_STEP, "--max_steps", "2"]
    main(["train", "--output_dir", "straight", *two_steps])
    checkpoint = stored(in_folder / "straight" / "checkpoint-1")
    base = stored(in_folder / "my-model")
    output_layer = "embed_out.weight" if "embed_out.weight" in checkpoint else "lm_head.weight"
    assert (
        checkpoint.get(output_layer, checkpoint.get("model.decoder.embed_tokens.weight"))
        - base.get(output_layer, base.get("model.decoder.embed_tokens.weight"))
    ).abs().max() > 1e-3
    resumed_from = str(in_folder / "straight" / "checkpoint-1")
    main(["train", "--output_dir", "resumed", *two_steps, "--resume_from_checkpoint", resumed_from])
    resumed, straight = stored(in_folder / "resumed"), stored(in_folder / "straight")
    assert resumed.keys() == straight.keys() == checkpoint.keys()
    for name, weight in straight.items():
        assert resumed[name].equal(weight), name
    with pytest.raises(SystemExit) as stop:
        main(["train", "--output_dir", "straight", *two_steps, "--resume_from_checkpoint", "true"])
    message = str(stop.value.code)
    assert message.startswith("topr-trl: checkpoint-2 already reached step 2, so --max_steps 2") and "\n" not in message
    assert all(stored(in_folder / "straight")[name].equal(weight) for name, weight in straight.items())


def test_a_checkpoint_of_another_architecture_is_refused_in_one_line(in_folder, architecture_folder, tmp_path):
    """Resuming from another model's checkpoint would leave this model's weights as they were: one line names it,
    nothing is trained."""
    other = "opt" if architecture_folder.name.startswith("gptneox") else "gptneox"
    foreign = tmp_path / "foreign"
    subprocess.run(
        [sys.executable, str(MAKER), str(foreign), *ARCHITECTURES[other]], check=True, capture_output=True, timeout=600
    )
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "train",
                "--model_name_or_path",
                "my-model",
                "--output_dir",
                "refused",
                *ONE_STEP,
                "--resume_from_checkpoint",
                str(foreign / "my-model"),
            ]
        )
    message = str(stop.value.code)
    assert message.startswith("topr-trl: the checkpoint") and "\n" not in message, message
    assert "does not" in message


def test_the_asynchronous_trainer_trains_each_architecture_and_saves_its_config_as_it_was(in_folder):
    """TRL's FLOPs count read `num_key_value_heads` (and `intermediate_size`), which GPTNeoX's and OPT's configs do
    not have: the first step raised AttributeError. Now the run trains and logs TRL's step metrics, and the saved
    config has the fields the model came with, no more."""
    import json

    main(
        [
            "train",
            "--model_name_or_path",
            "my-model",
            "--output_dir",
            "asynchronous",
            *ONE_STEP[:-4],
            "--max_steps",
            "2",
            "--asynchronous",
            "true",
        ]
    )
    summary = json.loads((in_folder / "asynchronous" / "topr_summary.json").read_text())
    assert summary["steps"] == 2
    state = json.loads((in_folder / "asynchronous" / "trainer_state.json").read_text())
    assert any("batch/forwarded_tokens_per_step" in entry for entry in state["log_history"])
    saved = json.loads((in_folder / "asynchronous" / "config.json").read_text())
    original = json.loads((in_folder / "my-model" / "config.json").read_text())
    assert set(saved) - {"dtype", "transformers_version"} <= set(original)


def test_a_completion_length_beyond_the_models_positions_is_refused_in_one_line(in_folder):
    """OPT's learned positions end at 256 here: the default max_completion_length (512) died with "index out of range
    in self" at the first generation; now one line names the model's positions, and a length that fits with the
    prompt names the longest prompt's row. GPTNeoX's rotary positions have no such end: nothing is refused."""
    import json

    from transformers import AutoConfig

    from topr_trl.inputs.prompts import model_positions

    positions = model_positions(AutoConfig.from_pretrained(in_folder / "my-model"))
    if "rope_parameters" in json.loads((in_folder / "my-model" / "config.json").read_text()):
        assert positions is None
        return
    assert positions == 256
    run = ["train", "--model_name_or_path", "my-model", "--output_dir", "too-long", *ONE_STEP]
    at = run.index("--max_completion_length")
    for length, says in (
        (positions, f"leaves no room for a prompt in the model's {positions} positions"),
        (positions - 2, f"and the model has {positions} (max_position_embeddings)"),
    ):
        run[at + 1] = str(length)
        with pytest.raises(SystemExit) as stop:
            main(run)
        message = str(stop.value.code)
        assert message.startswith("topr-trl: ") and "\n" not in message and says in message, message
    assert not (in_folder / "too-long").exists()


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory) -> Path:
    """A user's tiny Mistral (sliding-window attention, rotary positions, 512 trained positions)."""
    if not MAKER.is_file():
        pytest.skip(f"the shared user-folder tool is not beside the repository ({MAKER})")
    folder = tmp_path_factory.mktemp("mistral")
    subprocess.run([sys.executable, str(MAKER), str(folder), "--arch", "mistral"], check=True, capture_output=True)
    return folder


def test_completions_past_a_rotary_models_trained_context_are_said_in_one_line(mistral_folder, monkeypatch, capsys):
    """A rotary model runs past its `max_position_embeddings` without failing, so the run goes on (as GRPOTrainer's
    does), but it says so in one line before any weight loads, with the length that stays within the context; a run
    within it says nothing of the kind. (Learned positions past their table are refused: test_cli_user_folder.)"""
    work_in(mistral_folder, monkeypatch)
    run = ["train", "--model_name_or_path", "my-model", "--output_dir", "long", *ONE_STEP]
    main([*run, "--max_completion_length", "600"])
    said = [line for line in capsys.readouterr().out.splitlines() if "past the 512 the model was trained on" in line]
    assert len(said) == 1 and "--max_completion_length 600 reach" in said[0], said
    longest = int(said[0].split("prompts of up to ")[1].split(" ")[0])
    assert f"lower --max_completion_length to {512 - longest} to stay within it" in said[0]
    main([*run[:4], "within", *ONE_STEP, "--max_completion_length", str(512 - longest)])
    assert "the model was trained on" not in capsys.readouterr().out


def made_folder(tmp_path_factory, arch: str) -> Path:
    if not MAKER.is_file():
        pytest.skip(f"the shared user-folder tool is not beside the repository ({MAKER})")
    folder = tmp_path_factory.mktemp(arch)
    subprocess.run(
        [sys.executable, str(MAKER), str(folder), "--arch", arch], check=True, capture_output=True, timeout=600
    )
    return folder


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory) -> Path:
    """A user's Mixture-of-Experts model, Mixtral with `output_router_logits` on (its config's default here)."""
    return made_folder(tmp_path_factory, "mixtral")


def test_a_mixtral_returning_router_logits_generates_trains_and_evaluates(mixtral_folder, monkeypatch):
    """Mixtral's router loss cannot be computed for a cached generation step over left-padded prompts (transformers
    raises a shape error in `load_balancing_loss_func`): before, `generate` and `evaluate` stopped at the first batch
    and online `train` at the first batch with prompts of several lengths (8 here). Generation now skips the router
    logits it never reads; training's forward keeps them, so the auxiliary loss still trains the router."""
    import json
    import math

    work_in(mixtral_folder, monkeypatch)
    assert json.loads((mixtral_folder / "my-model" / "config.json").read_text())["output_router_logits"] is True
    data = ["--dataset_name", "data/prompts.jsonl", "--reward_funcs", "my_rewards:correctness"]
    main(["generate", "--model_name_or_path", "my-model", *data, "--num_generations", "4", "--max_prompts", "8",
          "--max_completion_length", "16", "--output_dir", "generated"])  # fmt: skip
    assert len(list((mixtral_folder / "generated").glob("shard-*"))) == 1
    main(["train", "--model_name_or_path", "my-model", *data, "--per_device_train_batch_size", "8",
          "--num_generations", "4", "--max_completion_length", "16", "--max_steps", "2", "--topr_unscored_batch",
          "train", "--output_dir", "trained"])  # fmt: skip
    state = json.loads((mixtral_folder / "trained" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and all(
        math.isfinite(entry["loss"]) for entry in state["log_history"] if "loss" in entry
    )
    main(["evaluate", "--model_name_or_path", "trained", *data, "--limit", "8", "--num_samples", "2", "--k", "1",
          "--max_new_tokens", "16", "--no_plot", "--no_progress", "--output_dir", "evaluated"])  # fmt: skip
    assert json.loads((mixtral_folder / "evaluated" / "results.json").read_text())["summary"]["num_prompts"] == 8


def test_asynchronous_training_of_a_model_without_sdpa_is_refused_in_one_line(tmp_path_factory, monkeypatch, capsys):
    """Gemma2 (its attention soft-caps the logits) has no SDPA attention in transformers, which the asynchronous
    trainer's packed forward runs on without CUDA: before, transformers' advice to load it with "eager" attention,
    which cannot help; now one line naming the way that works, before any step."""
    work_in(made_folder(tmp_path_factory, "gemma2"), monkeypatch)
    with pytest.raises(SystemExit) as stop:
        main(["train", "--asynchronous", "true", "--model_name_or_path", "my-model", *ONE_STEP, "--output_dir", "run"])
    message = str(stop.value)
    assert "Gemma2ForCausalLM" in message and "without --asynchronous" in message and "eager" not in message
    assert len(message.splitlines()) == 1
    assert not (Path("run") / "trainer_state.json").exists()


def test_the_held_out_word_problem_measure_shows_its_progress(tmp_path_factory, capfd):
    """The real-model run's held-out measure (sampled, then greedy) takes minutes on a CPU: before, nothing was printed
    meanwhile; now a bar of samples done and time left, for each of the two passes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from topr_trl.tasks.word_problems import make_word_problems, measure_word_problems

    folder = made_folder(tmp_path_factory, "qwen2") / "my-model"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    result = measure_word_problems(model, tokenizer, make_word_problems(3, "test"), num_samples=2)
    bars = [line for line in capfd.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("evaluate")]
    assert result["num_problems"] == 3
    assert any("6/6" in bar for bar in bars) and any("3/3" in bar for bar in bars), bars
