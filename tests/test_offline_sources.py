"""Offline data from anywhere: sources (shards, save_to_disk, jsonl, parquet, csv), the columns TOPRTrainer checks at
construction, replay of the stored prompt and completion ids (the BOS bug), evaluation on offline data, and the
refusals of reward functions that cannot train anything."""

import logging
import math
import re

import pytest
import torch
from datasets import Dataset
from tokenizers import processors
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.inputs.prompts import tokenize_prompts
from topr_trl.offline import (
    completion_token_ids,
    generate_offline_dataset,
    load_offline_dataset,
    load_offline_source,
    stored_reward,
)
from topr_trl.offline.rollout import make_behaviour_rollout
from topr_trl.tasks.tiny import CHAT_TEMPLATE, build_model, build_tokenizer, save_pretrained

from .conftest import logged_values, parity_reward, small_config_kwargs, small_trainer


PLAIN_PROMPTS = Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+6=", "7+8="], "answer": ["3", "7", "11", "15"]})


def logged(trainer, key) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


def first_step_ratio_range(trainer) -> tuple[float, float]:
    """The smallest and largest sequence ratio pi/mu of the first logged step, over both branches."""
    entry = next(entry for entry in trainer.state.log_history if "topr/ratio_positive/min" in entry)
    values = [entry[f"topr/ratio_{branch}/{end}"] for branch in ("positive", "negative") for end in ("min", "max")]
    values = [v for v in values if v is not None and not math.isnan(v)]
    assert values, entry
    return min(values), max(values)


@pytest.fixture(scope="module")
def generated(behaviour_model_path, arithmetic_dataset, tmp_path_factory):
    """8 rows (2 prompts x 4 completions) sampled from the behaviour model, in generate's shard folder."""
    model = AutoModelForCausalLM.from_pretrained(behaviour_model_path)
    tokenizer = AutoTokenizer.from_pretrained(behaviour_model_path)
    directory = tmp_path_factory.mktemp("generated")
    torch.manual_seed(0)
    generate_offline_dataset(
        model,
        tokenizer,
        arithmetic_dataset.select(range(2)),
        parity_reward,
        directory,
        num_completions=4,
        max_new_tokens=6,
        show_progress=False,
    )
    return directory


def offline_trainer(model_path, dataset, output_dir, reward_funcs=stored_reward, **overrides):
    settings = dict(per_device_train_batch_size=8, max_steps=1)
    settings.update(overrides)
    args = TOPRConfig(**small_config_kwargs(output_dir, **settings))
    return TOPRTrainer(model=model_path, reward_funcs=reward_funcs, args=args, train_dataset=dataset)


# ---------------------------------------------------------------------------------------------- sources
@pytest.mark.parametrize("form", ["shards", "save_to_disk", "jsonl", "parquet"])
def test_offline_dataset_from_any_source_trains_on_what_was_stored(form, generated, tiny_model_path, tmp_path):
    stored = load_offline_dataset(generated)
    source = {
        "shards": generated,
        "save_to_disk": tmp_path / "saved",
        "jsonl": tmp_path / "data.jsonl",
        "parquet": tmp_path / "parquet",
    }[form]
    if form == "save_to_disk":
        stored.save_to_disk(str(source))
    elif form == "jsonl":
        stored.to_json(str(source))
    elif form == "parquet":  # a folder of parquet files
        source.mkdir()
        stored.select(range(4)).to_parquet(str(source / "part-0.parquet"))
        stored.select(range(4, 8)).to_parquet(str(source / "part-1.parquet"))
    dataset = load_offline_source(str(source))
    assert list(dataset["completion_ids"]) == list(stored["completion_ids"])
    assert list(dataset["prompt_ids"]) == list(stored["prompt_ids"])
    trainer = offline_trainer(tiny_model_path, dataset, tmp_path / "run")
    trainer.model.generate = None  # offline: the policy never generates
    trainer.train()
    # one step over the whole dataset: the logged reward is the mean of the stored rewards
    assert logged(trainer, "reward") == [pytest.approx(sum(stored["reward"]) / len(stored))]
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))


def test_csv_offline_dataset_with_completion_text(behaviour_model_path, tiny_model_path, tmp_path):
    """CSV holds no lists: completions are text, tokenized once at construction (EOS appended unless truncated);
    mu's log-probs come from the behaviour model."""
    labelled = [("3", 1.0), ("7", -1.0), ("12", -1.0), ("99", -1.0)]
    rows = [
        {"prompt": f"{a}+{b}=", "completion": completion, "truncated": completion == "99", "reward": reward}
        for a, b in [(1, 2), (3, 4)]
        for completion, reward in labelled
    ]
    Dataset.from_list(rows).to_csv(str(tmp_path / "data.csv"))
    dataset = load_offline_source(str(tmp_path / "data.csv"))
    trainer = offline_trainer(tiny_model_path, dataset, tmp_path / "run", topr_behaviour_model=behaviour_model_path)
    tokenizer = trainer.processing_class
    digits = {text: tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("3", "7", "12", "99")}
    eos = tokenizer.eos_token_id
    expected = [digits[row["completion"]] + ([] if row["truncated"] else [eos]) for row in rows]
    assert list(trainer.train_dataset["completion_ids"]) == expected
    assert list(trainer.train_dataset["prompt_index"]) == [0] * 4 + [1] * 4
    trainer.model.generate = None
    trainer.train()
    assert logged(trainer, "reward") == [pytest.approx(-0.5)]


def test_completion_text_is_tokenized_with_eos_unless_truncated():
    tokenizer = build_tokenizer()
    eos, one, two = tokenizer.eos_token_id, *tokenizer("12", add_special_tokens=False)["input_ids"]
    assert completion_token_ids(tokenizer, ["12", "12", "12" + tokenizer.eos_token], [False, True, False]) == [
        [one, two, eos],
        [one, two],
        [one, two, eos],
    ]
    assert completion_token_ids(tokenizer, [[{"role": "assistant", "content": "12"}]]) == [[one, two, eos]]


def test_missing_or_empty_sources_fail_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*topr-trl generate"):
        load_offline_source(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no offline dataset"):
        load_offline_source(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="holds no offline dataset"):
        load_offline_source(str(tmp_path / "notes.txt"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Dataset.from_dict({"prompt": ["a"]}).to_json(str(mixed / "a.jsonl"))
    Dataset.from_dict({"prompt": ["b"]}).to_parquet(str(mixed / "b.parquet"))
    with pytest.raises(ValueError, match="mixes data file formats"):
        load_offline_source(str(mixed))


# ---------------------------------------------------------------------------------------------- refusals
def test_stored_rewards_without_completions_are_refused(generated, tiny_model_path, tmp_path):
    rewards_only = load_offline_dataset(generated).remove_columns(["completion_ids", "completion"])
    for reward_funcs in (stored_reward, parity_reward):
        with pytest.raises(
            ValueError,
            match=r"stored rewards \['reward', 'rewards/parity_reward'\] but no "
            r"completions.*topr-trl generate.*`completion` column",
        ):
            offline_trainer(tiny_model_path, rewards_only, tmp_path, reward_funcs=reward_funcs)


def test_stored_reward_without_a_reward_column_is_refused(generated, tiny_model_path, arithmetic_dataset, tmp_path):
    unlabelled = load_offline_dataset(generated).remove_columns(["reward", "rewards/parity_reward"])
    with pytest.raises(ValueError, match="offline train_dataset has no `reward` column.*real reward functions"):
        offline_trainer(tiny_model_path, unlabelled, tmp_path)
    offline_trainer(tiny_model_path, unlabelled, tmp_path, reward_funcs=parity_reward)  # real rewards: accepted
    with pytest.raises(ValueError, match="train_dataset has no `reward` column.*real reward functions"):
        offline_trainer(tiny_model_path, arithmetic_dataset, tmp_path)  # a prompt dataset with stored_reward


def test_offline_eval_dataset_is_checked_like_the_train_dataset(
    generated, tiny_model_path, arithmetic_dataset, tmp_path
):
    stored = load_offline_dataset(generated)
    for eval_dataset, signal, message in [
        (stored.remove_columns("reward"), "advantage", "offline eval_dataset has no `reward` column"),
        (arithmetic_dataset, "advantage", "eval_dataset has no `reward` column for topr_trl.offline.stored_reward"),
        (
            stored.select(range(6)),
            "advantage",
            r"prompt group\(s\) of offline eval_dataset do not have "
            "num_generations_eval=4 rows",
        ),
        (stored.select(range(6)), "reward", "eval_dataset has 6 rows, not a multiple of num_generations_eval=4"),
    ]:
        args = TOPRConfig(**small_config_kwargs(tmp_path, per_device_train_batch_size=8, topr_signal=signal))
        with pytest.raises(ValueError, match=message):
            TOPRTrainer(
                model=tiny_model_path,
                reward_funcs=stored_reward,
                args=args,
                train_dataset=stored,
                eval_dataset=eval_dataset,
            )


def test_behaviour_logps_that_do_not_match_the_completion_are_refused(generated, tiny_model_path, tmp_path):
    stored = load_offline_dataset(generated)
    shortened = stored.map(
        lambda row, i: {"behaviour_logps": row["behaviour_logps"][:-1] if i == 5 else row["behaviour_logps"]},
        with_indices=True,
    )
    with pytest.raises(ValueError, match="row 5 has .* behaviour_logps for .* completion tokens"):
        offline_trainer(tiny_model_path, shortened, tmp_path)


def test_prompt_index_is_derived_from_identical_prompts(generated, tiny_model_path, tmp_path):
    stored = load_offline_dataset(generated)
    interleaved = stored.select([0, 4, 1, 5, 2, 6, 3, 7]).remove_columns("prompt_index")
    trainer = offline_trainer(
        tiny_model_path, interleaved, tmp_path / "run", per_device_train_batch_size=4, max_steps=2
    )  # the group advantage needs whole groups: checked on the derived index
    assert list(trainer.train_dataset["prompt_index"]) == [0, 1, 0, 1, 0, 1, 0, 1]
    order = list(trainer._get_train_sampler())
    assert [interleaved[i]["prompt"] for i in order[:4]] == [interleaved[order[0]]["prompt"]] * 4
    trainer.train()
    with pytest.raises(ValueError, match="do not have num_generations=4 rows"):
        offline_trainer(
            tiny_model_path, interleaved.select(range(7)), tmp_path / "uneven", per_device_train_batch_size=4
        )


# ---------------------------------------------------------------------------------------------- replay (BOS bug)
@pytest.fixture(scope="module")
def bos_model_path(tmp_path_factory) -> str:
    """A tiny model whose tokenizer adds BOS to plain text (as Llama's does), with a chat template that takes a
    `style` kwarg (as Qwen3's takes `enable_thinking`)."""
    tokenizer = build_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{{ '<|im_start|>assistant\n' }}",
        "{{ '<|im_start|>assistant\n' }}{% if style == 'brief' %}{{ 'Brief: ' }}{% endif %}",
    )
    return str(save_pretrained(build_model(tokenizer, seed=5), tokenizer, tmp_path_factory.mktemp("bos-model")))


def generate_from(model_path, prompts, directory, **kwargs):
    """mu = the policy's own weights: with learning_rate 0, pi/mu must be 1 on every stored completion."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)
    torch.manual_seed(0)
    return generate_offline_dataset(
        model,
        tokenizer,
        prompts,
        parity_reward,
        directory,
        num_completions=4,
        max_new_tokens=6,
        show_progress=False,
        **kwargs,
    )


def test_bos_plain_prompts_replay_with_ratio_one(bos_model_path, tmp_path):
    data = generate_from(bos_model_path, PLAIN_PROMPTS, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(bos_model_path)
    assert tokenizer("1+2=")["input_ids"][0] == tokenizer.bos_token_id  # the setting the bug needs
    assert all(ids[0] == tokenizer.bos_token_id for ids in data["prompt_ids"])
    assert list(data["prompt_ids"]) == tokenize_prompts(tokenizer, list(data["prompt"]))
    for name, dataset in [
        ("stored prompt_ids", data),
        ("tokenized at construction", data.remove_columns("prompt_ids")),
    ]:
        trainer = offline_trainer(
            bos_model_path, dataset, tmp_path / name, learning_rate=0.0, per_device_train_batch_size=16
        )
        assert list(trainer.train_dataset["prompt_ids"]) == list(data["prompt_ids"]), name
        trainer.train()
        low, high = first_step_ratio_range(trainer)
        assert low == pytest.approx(1.0, abs=1e-5) and high == pytest.approx(1.0, abs=1e-5), (name, low, high)


def test_chat_template_kwargs_reach_generation_and_replay(bos_model_path, tmp_path):
    conversational = PLAIN_PROMPTS.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    brief = {"style": "brief"}
    data = generate_from(bos_model_path, conversational, tmp_path / "data", chat_template_kwargs=brief)
    tokenizer = AutoTokenizer.from_pretrained(bos_model_path)
    assert tokenizer.decode(data["prompt_ids"][0]).endswith("assistant\nBrief: ")
    for name, dataset in [
        ("stored prompt_ids", data),
        ("tokenized at construction", data.remove_columns("prompt_ids")),
    ]:
        trainer = offline_trainer(
            bos_model_path,
            dataset,
            tmp_path / name,
            learning_rate=0.0,
            per_device_train_batch_size=16,
            chat_template_kwargs=brief,
        )
        assert list(trainer.train_dataset["prompt_ids"]) == list(data["prompt_ids"]), name
        trainer.train()
        low, high = first_step_ratio_range(trainer)
        assert low == pytest.approx(1.0, abs=1e-5) and high == pytest.approx(1.0, abs=1e-5), (name, low, high)
    # the check can fail: conditioning pi on another prompt than mu's (no kwarg here) moves the ratios off 1
    mismatched = offline_trainer(
        bos_model_path,
        data.remove_columns("prompt_ids"),
        tmp_path / "mismatch",
        learning_rate=0.0,
        per_device_train_batch_size=16,
    )
    mismatched.train()
    low, high = first_step_ratio_range(mismatched)
    assert high - low > 1e-3


def test_shared_prompt_tokenization_is_grpo_trainers(bos_model_path, tmp_path):
    """`tokenize_prompts` (generation, behaviour rollout, construction) gives GRPOTrainer's own token ids."""
    tokenizer = AutoTokenizer.from_pretrained(bos_model_path)
    conversational = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "30+4="}]]
    for kwargs in ({}, {"style": "brief"}):
        trainer = small_trainer(bos_model_path, parity_reward, PLAIN_PROMPTS, tmp_path, chat_template_kwargs=kwargs)
        for prompts in (list(PLAIN_PROMPTS["prompt"]), conversational):
            assert tokenize_prompts(tokenizer, prompts, kwargs) == [
                list(ids) for ids in trainer._tokenize_prompts(prompts)[0]
            ]


def test_behaviour_rollout_of_the_policy_itself_gives_ratio_one(bos_model_path, tmp_path):
    behaviour = AutoModelForCausalLM.from_pretrained(bos_model_path)
    rollout = make_behaviour_rollout(behaviour, AutoTokenizer.from_pretrained(bos_model_path))
    args = TOPRConfig(**small_config_kwargs(tmp_path, learning_rate=0.0, max_steps=1, per_device_train_batch_size=16))
    trainer = TOPRTrainer(
        model=bos_model_path, reward_funcs=parity_reward, args=args, train_dataset=PLAIN_PROMPTS, rollout_func=rollout
    )
    prompts = list(PLAIN_PROMPTS["prompt"])
    assert rollout(prompts, trainer)["prompt_ids"] == [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
    trainer.train()
    low, high = first_step_ratio_range(trainer)
    assert low == pytest.approx(1.0, abs=1e-5) and high == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------- evaluation
def evaluated_config(output_dir, per_device_eval_batch_size: int) -> TOPRConfig:
    """Two steps on 8 rows each, evaluated after each step in batches of `per_device_eval_batch_size`."""
    return TOPRConfig(
        **small_config_kwargs(
            output_dir,
            per_device_train_batch_size=8,
            per_device_eval_batch_size=per_device_eval_batch_size,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=1,
        )
    )


def test_offline_eval_dataset_replays_its_stored_completions(generated, tiny_model_path, tmp_path):
    stored = load_offline_dataset(generated)
    labels = [1.0, -1.0, -1.0, 0.5, 1.0, 1.0, -1.0, 0.0]
    eval_data = stored.remove_columns("reward").add_column("reward", labels)
    args = evaluated_config(tmp_path, per_device_eval_batch_size=4)
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=stored, eval_dataset=eval_data
    )
    trainer.model.generate = None  # neither training nor evaluation generates
    trainer.train()
    assert logged(trainer, "eval_reward") == [pytest.approx(sum(labels) / len(labels))] * 2
    assert len(logged(trainer, "eval_loss")) == 2 and len(logged(trainer, "eval_topr/ratio_negative/mean")) == 2


def test_prompt_eval_dataset_during_offline_training_generates_from_the_policy(
    generated, tiny_model_path, arithmetic_dataset, tmp_path
):
    stored = load_offline_dataset(generated)
    args = evaluated_config(tmp_path, per_device_eval_batch_size=8)
    trainer = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=parity_reward,
        args=args,
        train_dataset=stored,
        eval_dataset=arithmetic_dataset.select(range(4)),
    )
    generate, modes = trainer.model.generate, []
    trainer.model.generate = lambda *a, **k: modes.append(trainer.model.training) or generate(*a, **k)
    trainer.train()
    assert modes and not any(modes)  # the policy generated, and only to evaluate
    rewards = logged(trainer, "eval_reward")
    assert len(rewards) == 2 and all(-1 <= r <= 1 for r in rewards)
    assert len(logged(trainer, "eval_completions/mean_length")) == 2


# ---------------------------------------------------------------------------------------------- reward functions
@pytest.mark.parametrize(
    "returned,message",
    [
        (1.0, "Reward function 'bad_reward' returned float 1.0; it must return a list of floats"),
        ("good", "Reward function 'bad_reward' returned str 'good'; it must return a list of floats"),
        (
            ["good"] * 8,
            "Reward function 'bad_reward' returned a list holding str 'good'; it must return a list of floats",
        ),
        ([1.0], "The reward function 'bad_reward' returned 1 rewards, but 8 were expected"),  # TRL's own check
    ],
)
def test_reward_function_with_a_wrong_return_type_fails_at_its_first_call(
    returned, message, tiny_model_path, arithmetic_dataset, tmp_path
):
    def bad_reward(completions, **kwargs):
        return returned

    trainer = small_trainer(tiny_model_path, bad_reward, arithmetic_dataset, tmp_path, per_device_train_batch_size=8)
    with pytest.raises((TypeError, ValueError), match=re.escape(message)) as raised:
        trainer.train()
    assert trainer.state.global_step == 0
    if message.startswith("Reward function"):  # ours, not TRL's: caught by code catching either exception
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)


def test_async_reward_function_keeps_working_and_is_checked(tiny_model_path, arithmetic_dataset, tmp_path):
    async def async_parity(completions, **kwargs):
        return parity_reward(completions)

    async def async_scalar(completions, **kwargs):
        return 1.0

    trainer = small_trainer(tiny_model_path, async_parity, arithmetic_dataset, tmp_path / "ok")
    trainer.train()
    assert len(logged(trainer, "rewards/async_parity/mean")) == 2  # TRL's name, from __name__
    trainer = small_trainer(tiny_model_path, async_scalar, arithmetic_dataset, tmp_path / "bad")
    with pytest.raises(TypeError, match="Reward function 'async_scalar' returned float"):
        trainer.train()


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def test_unscored_steps_stop_training_online_and_offline_when_asked(
    generated, tiny_model_path, arithmetic_dataset, tmp_path
):
    stop = dict(topr_unscored_batch="error")
    trainer = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=[none_reward, parity_reward],
        train_dataset=arithmetic_dataset,
        args=TOPRConfig(**small_config_kwargs(tmp_path / "mixed", **stop)),
    )
    trainer.train()  # one function scores: nothing to refuse
    trainer = small_trainer(tiny_model_path, none_reward, arithmetic_dataset, tmp_path / "online", **stop)
    with pytest.raises(
        ValueError,
        match=r"got None/NaN from every reward function \('none_reward'\).*"
        "topr_unscored_batch='skip'",
    ):
        trainer.train()
    unscored = load_offline_dataset(generated).map(lambda row: {"reward": float("nan")})
    with pytest.raises(ValueError, match=r"every reward function \('stored_reward'\)"):
        offline_trainer(tiny_model_path, unscored, tmp_path / "offline", **stop).train()


def test_unscored_steps_train_on_by_default_as_grpo_does(tiny_model_path, arithmetic_dataset, tmp_path, caplog):
    """GRPOTrainer warns and trains on; with a KL term the step still moves the model, as in GRPO."""
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=2, beta=0.04))
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=none_reward, train_dataset=arithmetic_dataset, args=args)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2
    assert "All reward functions returned None" in caplog.text  # TRL's own warning
    positive_losses = logged_values(trainer, "topr/loss_positive")
    assert len(positive_losses) == 2 and all(value == 0.0 for value in positive_losses)


def test_unscored_steps_can_be_skipped_with_one_warning(tiny_model_path, arithmetic_dataset, tmp_path, caplog):
    """Skipped means skipped: with an entropy bonus and a KL term the step would otherwise still move the model."""
    args = TOPRConfig(
        **small_config_kwargs(tmp_path, topr_unscored_batch="skip", max_steps=3, beta=0.04, entropy_coef=0.05)
    )
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=none_reward, train_dataset=arithmetic_dataset, args=args)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with caplog.at_level(logging.WARNING, logger="topr_trl.trainer"):
        trainer.train()
    assert trainer.state.global_step == 3
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=False))
    assert len([record for record in caplog.records if "Skipping steps" in record.getMessage()]) == 1
    with pytest.raises(ValueError, match="topr_unscored_batch.*Did you mean 'skip'"):
        TOPRConfig(**small_config_kwargs(tmp_path, topr_unscored_batch="skipp"))


def test_generation_refuses_a_reward_function_returning_a_scalar(behaviour_model_path, arithmetic_dataset, tmp_path):
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(behaviour_model_path),
        AutoTokenizer.from_pretrained(behaviour_model_path),
    )

    def scalar_reward(completions, **kwargs):
        return 0.0

    with pytest.raises(TypeError, match="Reward function 'scalar_reward' returned float"):
        generate_offline_dataset(
            model,
            tokenizer,
            arithmetic_dataset.select(range(1)),
            scalar_reward,
            tmp_path,
            num_completions=2,
            max_new_tokens=2,
            show_progress=False,
        )
    assert not list(tmp_path.glob("shard-*"))
