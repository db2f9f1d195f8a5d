"""Offline TOPR: dataset generation (schema, EOS, resume), composition, and training without generation."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.offline import (
    GroupShuffleSampler,
    compose,
    generate_offline_dataset,
    load_offline_dataset,
    proportion_of_positives,
    stored_reward,
)

from .conftest import parity_reward, small_config_kwargs, small_trainer


@pytest.fixture(scope="module")
def behaviour(behaviour_model_path):
    return AutoModelForCausalLM.from_pretrained(behaviour_model_path), AutoTokenizer.from_pretrained(
        behaviour_model_path
    )


def generate(behaviour, prompts, directory, **kwargs):
    model, tokenizer = behaviour
    settings = dict(num_completions=4, max_new_tokens=6, prompts_per_shard=2, prompts_per_batch=2, show_progress=False)
    settings.update(kwargs)
    torch.manual_seed(0)
    return generate_offline_dataset(model, tokenizer, prompts, parity_reward, directory, **settings)


def test_schema_round_trip_and_eos_kept(behaviour, arithmetic_dataset, tmp_path):
    prompts = arithmetic_dataset.select(range(5))
    dataset = generate(behaviour, prompts, tmp_path)
    assert len(dataset) == 20 and load_offline_dataset(tmp_path)["completion_ids"] == dataset["completion_ids"]
    for column in (
        "prompt",
        "answer",
        "prompt_index",
        "sample_index",
        "completion",
        "completion_ids",
        "behaviour_logps",
        "truncated",
        "reward",
        "rewards/parity_reward",
    ):
        assert column in dataset.column_names, column
    eos = behaviour[1].eos_token_id
    assert any(dataset["truncated"]) and not all(dataset["truncated"])  # both kinds, so the check below sees both
    for row in dataset:
        assert (row["completion_ids"][-1] == eos) == (not row["truncated"])
        assert len(row["behaviour_logps"]) == len(row["completion_ids"]) and max(row["behaviour_logps"]) <= 0
        assert row["reward"] == row["rewards/parity_reward"] == parity_reward([row["completion"]])[0]
    assert sorted(set(dataset["prompt_index"])) == list(range(5))


def test_stored_logps_are_those_of_the_truncated_sampling_distribution(behaviour, arithmetic_dataset, tmp_path):
    """With top_k=1 only the argmax survives truncation: renormalised, its probability is 1 (log-prob 0)."""
    dataset = generate(behaviour, arithmetic_dataset.select(range(2)), tmp_path, top_k=1)
    assert all(lp == pytest.approx(0.0, abs=1e-6) for row in dataset["behaviour_logps"] for lp in row)


def test_interrupted_generation_resumes_without_loss_or_duplicates(behaviour, arithmetic_dataset, tmp_path):
    prompts = arithmetic_dataset.select(range(6))
    calls = {"n": 0}

    def reward_that_dies_on_the_second_shard(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the job were killed while generating shard 2
        return parity_reward(completions)

    reward_that_dies_on_the_second_shard.__name__ = "parity_reward"
    with pytest.raises(KeyboardInterrupt):
        generate_offline_dataset(
            behaviour[0],
            behaviour[1],
            prompts,
            reward_that_dies_on_the_second_shard,
            tmp_path,
            num_completions=4,
            max_new_tokens=6,
            prompts_per_shard=2,
            prompts_per_batch=2,
            show_progress=False,
        )
    first_shard = load_offline_dataset(tmp_path)
    assert len(first_shard) == 8
    dataset = generate(behaviour, prompts, tmp_path)
    keys = list(zip(dataset["prompt_index"], dataset["sample_index"], strict=False))
    assert len(keys) == 24 and len(set(keys)) == 24
    assert dataset.select(range(8))["completion_ids"] == first_shard["completion_ids"]  # not regenerated


def test_resuming_with_other_settings_is_refused(behaviour, arithmetic_dataset, tmp_path):
    generate(behaviour, arithmetic_dataset.select(range(2)), tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        generate(behaviour, arithmetic_dataset.select(range(2)), tmp_path, temperature=0.5)


def labelled(rewards_per_prompt):
    rows = [
        {"prompt_index": p, "sample_index": s, "reward": r}
        for p, rewards in enumerate(rewards_per_prompt)
        for s, r in enumerate(rewards)
    ]
    return Dataset.from_list(rows)


def test_composition_strategies_produce_the_promised_counts():
    data = labelled([[-1, 1, 1, -1], [-1, -1, -1, -1], [1, 1, 1, 1], [-1, -1, 1, -1]])
    uniform, p = compose(data, "uniform")
    assert len(uniform) == 16 and p == pytest.approx(7 / 16) == proportion_of_positives(data)
    positives, p = compose(data, "positives_only")
    assert len(positives) == 7 and p == 1.0
    anna, p = compose(data, "anna_karenina")
    # first correct per prompt (prompts 0, 2, 3 have one) + all 9 incorrect
    assert len(anna) == 12 and p == pytest.approx(3 / 12)
    assert [(r["prompt_index"], r["sample_index"]) for r in anna if r["reward"] > 0] == [(0, 1), (2, 0), (3, 2)]
    for target in (0.1, 0.25, 0.5, 0.8):
        subset, p = compose(data, "target_proportion", target_proportion=target)
        assert abs(p - target) <= 1 / len(subset)
    with pytest.raises(ValueError, match="anna_karenina"):
        compose(data, "random")


def test_group_sampler_keeps_groups_together_and_repeats_batches():
    sampler = GroupShuffleSampler([0, 0, 1, 1, 2, 2, 3, 3], batch_rows=4, repeat_count=2, seed=1)
    order = list(sampler)
    assert len(order) == len(sampler) == 16
    assert order[:4] == order[4:8] and order[8:12] == order[12:16]
    for start in range(0, 16, 2):
        assert order[start] // 2 == order[start + 1] // 2  # both rows of a group, side by side
    assert sorted(set(order)) == list(range(8))


def test_offline_training_uses_stored_completions_and_mu(behaviour, tiny_model_path, arithmetic_dataset, tmp_path):
    dataset = generate(behaviour, arithmetic_dataset.select(range(8)), tmp_path / "data")
    args = TOPRConfig(**small_config_kwargs(tmp_path / "run", max_steps=4, per_device_train_batch_size=8))
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=dataset)
    trainer.model.generate = None  # offline: the policy must never generate
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=False))
    history = [entry for entry in trainer.state.log_history if "topr/ratio_positive/mean" in entry]
    ratios = [entry["topr/ratio_positive/mean"] for entry in history if entry["topr/ratio_positive/mean"] is not None]
    assert ratios and all(abs(r - 1) > 1e-3 for r in ratios)  # mu is the behaviour model, not the policy
    weights = [
        entry["topr/weight_negative/mean"] for entry in history if entry["topr/weight_negative/mean"] is not None
    ]
    assert weights and all(0 <= w <= 1 for w in weights)
    assert all(math.isfinite(entry["loss"]) for entry in history)


def test_offline_dataset_with_uneven_groups_needs_the_reward_signal(
    behaviour, tiny_model_path, arithmetic_dataset, tmp_path
):
    dataset = generate(behaviour, arithmetic_dataset.select(range(4)), tmp_path / "data")
    dataset = dataset.select([i for i in range(len(dataset)) if i != 3])
    with pytest.raises(ValueError, match="num_generations"):
        small_trainer(tiny_model_path, stored_reward, dataset, tmp_path / "run")
    args = TOPRConfig(**small_config_kwargs(tmp_path / "run2", topr_signal="reward", topr_baseline=0.0, max_steps=1))
    TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, train_dataset=dataset, args=args).train()


def test_dataset_without_behaviour_logps_is_rejected(behaviour, tiny_model_path, arithmetic_dataset, tmp_path):
    dataset = generate(behaviour, arithmetic_dataset.select(range(2)), tmp_path / "data").remove_columns(
        "behaviour_logps"
    )
    with pytest.raises(ValueError, match="behaviour_logps"):
        small_trainer(tiny_model_path, stored_reward, dataset, tmp_path / "run")


def test_dataset_smaller_than_one_batch_is_rejected_with_the_fix(
    behaviour, tiny_model_path, arithmetic_dataset, tmp_path
):
    """A curated composition can leave fewer rows than one generation batch; Trainer would then fail on an
    unrelated `max_steps` message."""
    dataset = generate(behaviour, arithmetic_dataset.select(range(1)), tmp_path / "data")  # 4 rows
    args = TOPRConfig(**small_config_kwargs(tmp_path / "run", per_device_train_batch_size=8))
    with pytest.raises(ValueError, match="4 rows, fewer than one batch of 8.*Lower per_device_train_batch_size"):
        TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, train_dataset=dataset, args=args)


def test_left_padded_prompts_get_the_same_log_probs(tiny_model_path):
    """TRIBE's pitfall: left padding must not shift positions (transformers derives them from the mask)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    padded = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9]])
    plain = model(input_ids=ids).logits[0, -3:]
    shifted = model(input_ids=padded, attention_mask=(padded != 0).long()).logits[0, -3:]
    torch.testing.assert_close(plain, shifted, atol=1e-4, rtol=1e-4)


def test_dataset_scope_baseline_is_solved_once_from_the_dataset(
    behaviour, tiny_model_path, arithmetic_dataset, tmp_path
):
    from topr_trl.loss import baseline_for_target_share

    dataset = generate(behaviour, arithmetic_dataset.select(range(8)), tmp_path / "data")
    args = TOPRConfig(
        **small_config_kwargs(
            tmp_path / "run",
            topr_signal="reward",
            max_steps=3,
            topr_target_effective_proportion=0.2,
            topr_baseline_scope="dataset",
        )
    )
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=dataset)
    trainer.train()
    expected = baseline_for_target_share(torch.tensor(dataset["reward"]), 0.2)
    baselines = [entry["topr/baseline"] for entry in trainer.state.log_history if "topr/baseline" in entry]
    assert len(baselines) == 3 and all(c == pytest.approx(expected) for c in baselines)
    with pytest.raises(ValueError, match="offline"):
        TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, train_dataset=arithmetic_dataset, args=args)


def test_missing_behaviour_logps_are_recomputed_by_a_frozen_mu(
    behaviour, behaviour_model_path, tiny_model_path, arithmetic_dataset, tmp_path
):
    stored = generate(behaviour, arithmetic_dataset.select(range(2)), tmp_path / "data")
    args = TOPRConfig(
        **small_config_kwargs(
            tmp_path / "run", per_device_train_batch_size=8, topr_behaviour_model=behaviour_model_path
        )
    )
    with_column = TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, train_dataset=stored, args=args)
    without = TOPRTrainer(
        model=tiny_model_path,
        reward_funcs=stored_reward,
        args=args,
        train_dataset=stored.remove_columns("behaviour_logps"),
    )
    assert with_column._behaviour_model is None and without._behaviour_model is not None
    rows = [stored[i] for i in range(8)]
    with_column.model.train()
    without.model.train()
    reference = with_column._generate_and_score_completions([dict(r) for r in rows])
    recomputed = without._generate_and_score_completions(
        [{k: v for k, v in r.items() if k != "behaviour_logps"} for r in rows]
    )
    mask = reference["completion_mask"].bool()
    torch.testing.assert_close(
        recomputed["sampling_per_token_logps"][mask], reference["sampling_per_token_logps"][mask], atol=1e-4, rtol=1e-4
    )
    without.train()
    assert all(math.isfinite(entry["loss"]) for entry in without.state.log_history if "loss" in entry)


@pytest.mark.parametrize("epochs,steps", [(None, 4), (2.0, 8)])
def test_offline_data_gets_one_pass_by_default(epochs, steps, behaviour, tiny_model_path, arithmetic_dataset, tmp_path):
    dataset = generate(behaviour, arithmetic_dataset.select(range(8)), tmp_path / "data")  # 32 rows
    extra = {} if epochs is None else {"topr_offline_epochs": epochs}
    args = TOPRConfig(**small_config_kwargs(tmp_path / "run", max_steps=-1, per_device_train_batch_size=8, **extra))
    assert args.num_train_epochs == 3.0  # TrainingArguments' default, meant for online training
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=dataset)
    trainer.train()
    assert trainer.state.global_step == steps
    assert args.num_train_epochs == 3.0 and trainer.args is args  # the user's config is not changed


def test_generated_dataset_can_be_pushed(behaviour, arithmetic_dataset, tmp_path, monkeypatch):
    pushed = []
    monkeypatch.setattr(
        Dataset, "push_to_hub", lambda self, repo, private=True: pushed.append((repo, len(self), private))
    )
    generate(behaviour, arithmetic_dataset.select(range(2)), tmp_path, push_to_hub="me/topr-data")
    assert pushed == [("me/topr-data", 8, True)]


# ---------------------------------------------------------------------------------------------- vLLM backend
def test_vllm_backend_writes_the_same_schema_with_processed_logps(
    behaviour_model_path, behaviour, arithmetic_dataset, tmp_path, monkeypatch
):
    """Through a stand-in with vLLM's API (tests/fake_vllm.py): the engine is asked for processed log-probs, prompts
    go in as the same token ids the transformers path uses, and the rows match that path's schema, with EOS kept and
    log mu equal to log softmax(logits / T) of the model at every sampled token."""
    from . import fake_vllm

    fake_vllm.install(monkeypatch)
    model, tokenizer = behaviour
    prompts = arithmetic_dataset.select(range(3))
    through_vllm = generate_offline_dataset(
        behaviour_model_path,
        tokenizer,
        prompts,
        parity_reward,
        tmp_path / "v",
        num_completions=4,
        max_new_tokens=6,
        temperature=0.7,
        prompts_per_shard=2,
        show_progress=False,
        backend="vllm",
        seed=3,
    )
    through_transformers = generate(behaviour, prompts, tmp_path / "t", temperature=0.7)
    assert through_vllm.column_names == through_transformers.column_names
    assert len(through_vllm) == len(through_transformers) == 12
    engine = fake_vllm.LLM.instances[-1]
    assert engine.logprobs_mode == "processed_logprobs"
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(prompts[0]["prompt"], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    assert engine.requests[0] == expected_prompt
    assert through_vllm["prompt_index"] == [0] * 4 + [1] * 4 + [2] * 4
    for row in through_vllm:
        assert (row["completion_ids"][-1] == tokenizer.eos_token_id) == (not row["truncated"])
        prompt_ids = tokenizer(
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + row["completion_ids"]])).logits[0].float()
        steps = torch.log_softmax(logits[len(prompt_ids) - 1 : -1] / 0.7, -1)
        expected = steps.gather(-1, torch.tensor(row["completion_ids"]).unsqueeze(-1)).squeeze(-1)
        assert row["behaviour_logps"] == pytest.approx(expected.tolist(), abs=1e-4)
        assert row["reward"] == parity_reward([row["completion"]])[0]


def test_vllm_backend_maps_top_k(behaviour_model_path, behaviour, arithmetic_dataset, tmp_path, monkeypatch):
    """top_k=1 reaches vLLM as top_k=1 (and top_k=0, "none", as vLLM's -1): only the argmax survives, log-prob 0."""
    from . import fake_vllm

    fake_vllm.install(monkeypatch)
    dataset = generate_offline_dataset(
        behaviour_model_path,
        behaviour[1],
        arithmetic_dataset.select(range(2)),
        parity_reward,
        tmp_path,
        num_completions=2,
        max_new_tokens=4,
        top_k=1,
        show_progress=False,
        backend="vllm",
    )
    assert all(lp == pytest.approx(0.0, abs=1e-6) for row in dataset["behaviour_logps"] for lp in row)


def test_vllm_engine_built_here_is_released_and_a_finished_generation_builds_none(
    behaviour_model_path, behaviour, arithmetic_dataset, tmp_path, monkeypatch
):
    """The engine built from a model path frees its memory (vLLM's cleanup) before training needs it; rerunning a
    finished generation, as the other ranks of `accelerate launch` do, builds no engine; an engine passed in is the
    caller's and is not released; under an initialized process group vLLM's cleanup, which would destroy it, is
    skipped."""
    from topr_trl.generation.completions import make_vllm_engine

    from . import fake_vllm

    fake_vllm.install(monkeypatch)
    tokenizer, prompts = behaviour[1], arithmetic_dataset.select(range(2))
    settings = dict(num_completions=2, max_new_tokens=4, show_progress=False, backend="vllm")
    generate_offline_dataset(behaviour_model_path, tokenizer, prompts, parity_reward, tmp_path / "a", **settings)
    assert len(fake_vllm.LLM.instances) == 1 and fake_vllm.cleanups == ["cleanup_dist_env_and_memory"]
    generate_offline_dataset(behaviour_model_path, tokenizer, prompts, parity_reward, tmp_path / "a", **settings)
    assert len(fake_vllm.LLM.instances) == 1 and len(fake_vllm.cleanups) == 1
    engine = make_vllm_engine(behaviour_model_path)
    generate_offline_dataset(engine, tokenizer, prompts, parity_reward, tmp_path / "b", **settings)
    assert len(fake_vllm.cleanups) == 1 and engine.requests  # used, not released
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    generate_offline_dataset(behaviour_model_path, tokenizer, prompts, parity_reward, tmp_path / "c", **settings)
    assert len(fake_vllm.LLM.instances) == 3 and len(fake_vllm.cleanups) == 1


def test_auto_backend_uses_transformers_without_a_gpu(behaviour, arithmetic_dataset, tmp_path, monkeypatch):
    from . import fake_vllm

    fake_vllm.install(monkeypatch)  # vLLM "installed", but this machine has no CUDA device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    generate(behaviour, arithmetic_dataset.select(range(1)), tmp_path, backend="auto")
    assert fake_vllm.LLM.instances == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    generate(behaviour, arithmetic_dataset.select(range(1)), tmp_path / "gpu", backend="auto")
    assert len(fake_vllm.LLM.instances) == 1  # a loaded model is handed to vLLM by its name_or_path
    with pytest.raises(ValueError, match="Did you mean 'vllm'"):
        generate(behaviour, arithmetic_dataset.select(range(1)), tmp_path / "x", backend="vlm")


@pytest.mark.parametrize(
    "loss_type, whole", [("topr", False), ("off_policy_reinforce", False), ("kimi15", False), ("grpo", True)]
)
def test_only_losses_that_read_groups_need_whole_groups(loss_type, whole):
    """Every loss of TOPR's registry on R - c with a numeric baseline reads no prompt group; TRL's losses do."""
    from topr_trl.offline.schema import needs_whole_groups

    extra = {} if loss_type == "grpo" else {"topr_signal": "reward"}
    args = TOPRConfig(output_dir="/tmp/x", use_cpu=True, report_to="none", loss_type=loss_type, **extra)
    assert needs_whole_groups(args) is whole
