"""EvaluationCallback inside a real TOPRTrainer run on the tiny model."""

import json

import pytest

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.evaluation.callbacks import EvaluationCallback
from topr_trl.tasks.arithmetic import arithmetic_classify, make_arithmetic_dataset

from .conftest import parity_reward, small_config_kwargs


KEYS = ("pass@1", "pass@4", "maj@4", "invalid_rate")


def make_trainer(model_path, dataset, output_dir):
    args = TOPRConfig(**small_config_kwargs(output_dir, max_steps=4, disable_tqdm=True))
    return TOPRTrainer(model=model_path, reward_funcs=parity_reward, args=args, train_dataset=dataset)


def entries(trainer, key):
    return [(entry["step"], entry[key]) for entry in trainer.state.log_history if key in entry]


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory):
    """One 4-step run with three callbacks: every 2 steps (plus step 0), every 3 steps (plus the train end), and
    one without a trainer reference; and the same run without callbacks, to compare the training itself."""
    held_out = make_arithmetic_dataset(20, digits=1, seed=5)
    train = make_arithmetic_dataset(16, digits=1, seed=0)
    output = tmp_path_factory.mktemp("callbacks")
    trainer = make_trainer(tiny_model_path, train, output / "run")
    every_two = EvaluationCallback(
        held_out,
        arithmetic_classify,
        trainer=trainer,
        eval_steps=2,
        k=4,
        num_prompts=8,
        at_train_begin=True,
        output_dir=output / "evaluations",
    )
    every_three = EvaluationCallback(
        held_out, arithmetic_classify, trainer=trainer, eval_steps=3, k=2, num_prompts=4, prefix="eval3/"
    )
    detached = EvaluationCallback(
        held_out, arithmetic_classify, eval_steps=4, k=2, num_prompts=4, prefix="plain/", at_train_end=False
    )
    for callback in (every_two, every_three, detached):
        trainer.add_callback(callback)
    trainer.train()
    reference = make_trainer(tiny_model_path, train, output / "reference")
    reference.train()
    return trainer, reference, every_two, output


def test_metrics_logged_at_the_right_steps(trained):
    trainer, _, callback, _ = trained
    for name in KEYS:
        logged = entries(trainer, f"eval/{name}")
        assert [step for step, _ in logged] == [0, 2, 4], name  # no second evaluation at the train end (step 4)
        assert all(0.0 <= value <= 1.0 for _, value in logged), name
    assert [step for step, _ in callback.results] == [0, 2, 4]
    assert [value for _, value in entries(trainer, "eval/pass@1")] == [
        result.pass_at_1 for _, result in callback.results
    ]
    assert [value for _, value in entries(trainer, "eval/invalid_rate")] == [
        result.invalid_rate for _, result in callback.results
    ]
    assert all(result.num_prompts == 8 and result.k == 4 for _, result in callback.results)
    # Steps 3 and then the end of training (step 4, not a multiple of 3).
    assert [step for step, _ in entries(trainer, "eval3/pass@1")] == [3, 4]
    assert [step for step, _ in entries(trainer, "eval3/maj@2")] == [3, 4]
    # Without a trainer reference the entry is still appended to the log history.
    assert [step for step, _ in entries(trainer, "plain/pass@1")] == [4]


def test_training_logs_and_trajectory_are_unchanged(trained):
    trainer, reference, _, _ = trained
    # The trainer's own logging at the evaluated steps still happens, with the same values as without the
    # callbacks: evaluation samples in a forked random state and puts the model back in training mode.
    assert [step for step, _ in entries(trainer, "loss")] == [1, 2, 3, 4]
    assert entries(trainer, "loss") == entries(reference, "loss")
    assert entries(trainer, "reward") == entries(reference, "reward")
    assert trainer.model.training == reference.model.training


def test_results_saved_per_evaluation(trained):
    _, _, callback, output = trained
    for step, result in callback.results:
        document = json.loads((output / "evaluations" / f"step-{step}" / "results.json").read_text())
        assert document["summary"]["pass@1"] == pytest.approx(result.pass_at_1)
        assert (output / "evaluations" / f"step-{step}" / "results.png").is_file()


def test_rejects_bad_eval_steps():
    with pytest.raises(ValueError, match="eval_steps"):
        EvaluationCallback(make_arithmetic_dataset(2, digits=1), arithmetic_classify, eval_steps=0)
