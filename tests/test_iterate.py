"""Iterated offline TOPR: mu_i = pi_{i-1}, finished iterations skipped, a killed training resumed."""

import json

import pytest
from transformers import TrainerCallback

from topr_trl.commands.iterations import IterationSettings, run_iterations

from .conftest import parity_reward, ratio_extremes


def settings(**overrides):
    base = dict(
        num_iterations=1,
        num_completions=4,
        max_new_tokens=6,
        prompts_per_shard=4,
        save_steps=2,
        train_overrides=dict(
            per_device_train_batch_size=8,
            learning_rate=1e-2,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            logging_steps=1,
            seed=0,
        ),
    )
    base.update(overrides)
    return IterationSettings(**base)


class KillAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_iterations_chain_models_and_skip_finished_ones(tiny_model_path, arithmetic_dataset, tmp_path):
    prompts = arithmetic_dataset.select(range(8))
    evaluate_calls = []

    def evaluate(model, tokenizer):
        evaluate_calls.append(1)
        return {"calls": len(evaluate_calls)}

    first = run_iterations(tiny_model_path, prompts, parity_reward, tmp_path, settings(), evaluate=evaluate)
    assert len(first) == 1 and first[0]["behaviour_model"] == tiny_model_path and first[0]["rows"] == 32
    assert "evaluation_before" in first[0] and first[0]["train_steps"] == 4  # 32 rows / 8 per step, one pass
    shard_time = (tmp_path / "iteration-000" / "data" / "shard-00000").stat().st_mtime
    both = run_iterations(
        tiny_model_path, prompts, parity_reward, tmp_path, settings(num_iterations=2, composition="anna_karenina")
    )
    assert both[0] == first[0]  # finished iteration read back, not redone
    assert (tmp_path / "iteration-000" / "data" / "shard-00000").stat().st_mtime == shard_time
    assert both[1]["behaviour_model"] == str(tmp_path / "iteration-000" / "model")
    assert both[1]["composition"] == "anna_karenina"
    assert json.loads((tmp_path / "iteration-001" / "summary.json").read_text()) == both[1]


def test_killed_training_resumes_from_its_checkpoint(tiny_model_path, arithmetic_dataset, tmp_path):
    prompts = arithmetic_dataset.select(range(8))
    with pytest.raises(KeyboardInterrupt):
        run_iterations(tiny_model_path, prompts, parity_reward, tmp_path, settings(), callbacks=[KillAtStep(3)])
    assert (tmp_path / "iteration-000" / "train" / "checkpoint-2").exists()
    assert not (tmp_path / "iteration-000" / "summary.json").exists()
    resumed_from = []

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            resumed_from.append(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            resumed_from.append(state.global_step)

    summary = run_iterations(tiny_model_path, prompts, parity_reward, tmp_path, settings(), callbacks=[Record()])
    assert summary[0]["train_steps"] == 4
    assert resumed_from[1] == 3  # the first step run after resuming is step 3: steps 1-2 came from the checkpoint


def test_a_finished_iterations_model_is_freed_before_the_next_generation(
    tiny_model_path, arithmetic_dataset, tmp_path, monkeypatch
):
    """The next iteration may start a vLLM engine on the same GPU: by then the previous policy must be gone."""
    import weakref

    import topr_trl.offline.generation

    trained_models, alive_at_generation = [], []

    class RememberModel(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            trained_models.append(weakref.ref(model))

    real_generate = topr_trl.offline.generate_offline_dataset

    def generate(*args, **kwargs):
        alive_at_generation.append([reference() is not None for reference in trained_models])
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(topr_trl.offline.generation, "generate_offline_dataset", generate)
    run_iterations(
        tiny_model_path,
        arithmetic_dataset.select(range(4)),
        parity_reward,
        tmp_path,
        settings(num_iterations=2),
        callbacks=[RememberModel()],
    )
    assert alive_at_generation == [[], [False]]


def test_last_checkpoint_of_a_folder_another_process_has_not_created_yet_is_none(tmp_path):
    from topr_trl.runtime.distributed import last_checkpoint

    assert last_checkpoint(tmp_path / "train") is None
    for step in (3, 12):
        (tmp_path / "train" / f"checkpoint-{step}").mkdir(parents=True)
    assert last_checkpoint(tmp_path / "train") == str(tmp_path / "train" / "checkpoint-12")


@pytest.mark.parametrize("truncation", [{"top_k": 3}, {"top_p": 0.9}])
def test_an_iteration_sampled_with_truncation_trains_on_a_ratio_of_one_at_learning_rate_zero(
    truncation, tiny_model_path, arithmetic_dataset, tmp_path
):
    """An iteration generates with the user's top-k or top-p and trains on what it generated: the rows carry how mu
    sampled, so pi is scored on mu's support and at learning rate 0 every ratio is 1 within 1e-4 (on the tiny
    random-initialised model, near uniform, the whole-vocabulary score gives the kept mass: far below 1)."""
    overrides = dict(settings().train_overrides, learning_rate=0.0)
    run_iterations(
        tiny_model_path,
        arithmetic_dataset.select(range(4)),
        parity_reward,
        tmp_path,
        settings(train_overrides=overrides, **truncation),
    )
    history = json.loads((tmp_path / "iteration-000" / "train" / "trainer_state.json").read_text())["log_history"]
    ratios = ratio_extremes(history)
    assert ratios and all(ratio == pytest.approx(1.0, abs=1e-4) for ratio in ratios), ratios
