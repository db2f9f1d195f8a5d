"""Asynchronous TOPR (`topr_trl.asynchronous`): TRL's AsyncGRPOTrainer on a CPU, TOPR's packed loss against the
synchronous TOPR loss on the same samples, the mirrored forward against TRL's, the stand-in worker's lag, and the
no-drop rule."""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import float32_tolerance, logged_values, ratio_extremes
from topr_trl.asynchronous import AsyncTOPRConfig, AsyncTOPRTrainer, LaggedRolloutWorker
from topr_trl.asynchronous.cpu import cpu_capable, segment_batched_attention, tree_attention_mask, tree_attention_sdpa
from topr_trl.asynchronous.lagged_worker import group_advantages, summed_rewards
from topr_trl.loss import PolicyLossSpec, topr_loss
from topr_trl.tasks.reasoning import make_reasoning_dataset, max_completion_tokens, reasoning_reward
from topr_trl.tasks.tiny import prebuilt_model


os.environ.setdefault("HF_HUB_OFFLINE", "1")
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402


MODEL = str(prebuilt_model("reasoning-d3-q0.25-atall-steps3000-h64x2-seed0-108798e4f5"))
COMPLETION = max_completion_tokens(3)


# Rounding steps between two float32 computations of the same values by different paths (packed tree attention
# against a plain forward per completion; see `float32_tolerance`). A forward of this model (2 decoder layers) rounds
# in about 32 stages: embedding, final norm, lm_head, log-softmax, and per layer two RMS norms, the q/k/v and output
# projections, rotary embedding, attention scores, softmax, its weighted sum, gate/up projections, SiLU x up, down
# projection and two residual adds: 32 eps, 3.8e-6 relative. A backward to the (tied) embedding goes back through as
# many: 64 eps, 7.6e-6 of the largest gradient entry, where Intel (AVX-512, AVX2 and scalar kernels, 1 or 2 threads)
# gave at most 1.6e-6 and AMD EPYC 2.3e-6. A real bug is 1e-3 and up (1% more weight on one of 6 completions: 2.3e-3
# of the largest gradient entry, 1.7e-3 of the loss; a wrong aggregation 0.29 and 0.04).
FORWARD_ROUNDINGS = 32
BACKWARD_ROUNDINGS = 2 * FORWARD_ROUNDINGS


def async_kwargs(output_dir, **overrides) -> dict:
    kwargs = dict(
        output_dir=str(output_dir),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=COMPLETION,
        max_steps=3,
        learning_rate=1e-3,
        token_budget=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        heartbeat_stale_after_s=60,
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def make_worker(**overrides) -> LaggedRolloutWorker:
    kwargs = dict(num_generations=4, max_completion_length=COMPLETION, lockstep=True, samples_per_version=8)
    kwargs.update(overrides)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    return LaggedRolloutWorker(
        AutoModelForCausalLM.from_pretrained(MODEL), tokenizer, make_reasoning_dataset(16), reasoning_reward, **kwargs
    )


def build(trainer_class, args, worker=None):
    worker = worker or make_worker()
    return trainer_class(
        MODEL,
        reasoning_reward,
        args,
        train_dataset=make_reasoning_dataset(16),
        processing_class=AutoTokenizer.from_pretrained(MODEL),
        rollout_worker=worker,
        weight_transfer=worker.weight_transfer(),
    )


def packed_samples(seed: int = 0) -> list[dict]:
    """Two groups of three completions sharing their prompt (so TRL's tree packing shares it), with behaviour
    log-probs away from the policy's and signals of both signs."""
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for group, prompt in enumerate(["123+456=", "905+88="]):
        prompt_ids = tokenizer(prompt)["input_ids"]
        for index in range(3):
            completion = torch.randint(5, 60, (5 + 2 * index,), generator=generator).tolist()
            ids = prompt_ids + completion
            samples.append(
                {
                    "input_ids": np.asarray(ids),
                    "completion_mask": np.asarray([0] * len(prompt_ids) + [1] * len(completion)),
                    "old_log_probs": np.asarray(
                        [0.0] * len(prompt_ids) + (-3 + torch.randn(len(completion), generator=generator)).tolist(),
                        dtype=np.float32,
                    ),
                    "advantage": [1.0, -0.5, -1.5][index] * (1 if group == 0 else -1),
                    "group_id": group,
                    "metrics": {},
                }
            )
    return samples


def collate(samples: list[dict]) -> dict:
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return DataCollatorForRollout(pad_token_id=0, num_processes=1).torch_call([[row]])


def reference_logps(model, samples):
    """Each completion's token log-probs from a plain forward of prompt + completion alone (no packing)."""
    rows = []
    for sample in samples:
        ids = torch.as_tensor(sample["input_ids"]).unsqueeze(0)
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        token_logps = logps.gather(-1, ids[0, 1:, None])[:, 0]
        rows.append(token_logps[torch.as_tensor(sample["completion_mask"][1:]).bool()])
    return rows


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    values = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])
    mask = torch.stack([torch.arange(width) < len(row) for row in rows])
    return values, mask


# ---------------------------------------------------------------------------------------------------------
# Attention and loss
# ---------------------------------------------------------------------------------------------------------


def test_tree_attention_mask_matches_the_causal_rule_on_each_path():
    # two segments: a shared prompt of 3 tokens (path 0..2) and a branch of 2 tokens whose path is 0..4
    mask = tree_attention_mask(torch.tensor([0, 3, 5]), torch.tensor([0, 3, 8]), num_keys=8)
    expected = torch.zeros(5, 8, dtype=torch.bool)
    for query in range(3):
        expected[query, : query + 1] = True
    for offset in range(2):  # the branch's queries are positions 3 and 4 of its 5-key path
        expected[3 + offset, 3 : 3 + 3 + offset + 1] = True
    assert torch.equal(mask, expected)
    windowed = tree_attention_mask(torch.tensor([0, 3, 5]), torch.tensor([0, 3, 8]), num_keys=8, sliding_window=2)
    assert windowed[4].tolist() == [False] * 6 + [True, True]


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_segment_batched_tree_attention_equals_the_dense_mask_in_value_and_gradient(sliding_window):
    """Three prompts, each shared by completions of other lengths (queries the last of their path's keys), one
    segment of a single token: the padded per-segment batch gives the dense-mask SDPA's output and gradients, and
    the attention function picks it for such a row (its padded cost is below N x K)."""
    generator = torch.Generator().manual_seed(0)
    lengths_q = torch.tensor([5, 3, 7, 4, 1, 6, 2])
    lengths_k = torch.tensor([5, 8, 12, 4, 5, 6, 8])  # prompt segments see themselves; completions their prompt too
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), lengths_q.cumsum(0)]).int()
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lengths_k.cumsum(0)]).int()
    heads, size = 2, 8
    inputs = [
        torch.randn(heads, int(n), size, generator=generator, requires_grad=True)
        for n in (lengths_q.sum(), lengths_k.sum(), lengths_k.sum())
    ]
    mask = tree_attention_mask(cu_q, cu_k, int(lengths_k.sum()), sliding_window)
    dense = torch.nn.functional.scaled_dot_product_attention(*inputs, attn_mask=mask)
    upstream = torch.randn(dense.shape, generator=generator)
    expected = [dense] + list(torch.autograd.grad((dense * upstream).sum(), inputs))
    batched = segment_batched_attention(*inputs, cu_q, cu_k, sliding_window=sliding_window)
    got = [batched] + list(torch.autograd.grad((batched * upstream).sum(), inputs))
    # the same softmax over the same visible keys, summed in another order: a few roundings of the largest entry
    for name, value, reference in zip(("output", "d query", "d key", "d value"), got, expected, strict=True):
        assert torch.allclose(value, reference, **float32_tolerance(reference, 8)), (name, value - reference)
    segments, longest_q, longest_k = len(lengths_q), int(lengths_q.max()), int(lengths_k.max())
    assert segments * longest_q * longest_k < lengths_q.sum() * lengths_k.sum()
    through_trl_signature, _ = tree_attention_sdpa(
        None,
        inputs[0][None],
        inputs[1][None],
        inputs[2][None],
        None,
        tree_kv_index=torch.arange(int(cu_k[-1])),
        tree_cu_seqlens_q=cu_q,
        tree_cu_seqlens_k=cu_k,
        sliding_window=sliding_window,
    )
    assert torch.equal(through_trl_signature[0].transpose(0, 1), batched)


def test_trl_async_trainer_constructs_and_its_packed_forward_matches_plain_log_probs(tmp_path):
    trainer = build(cpu_capable(AsyncGRPOTrainer), AsyncGRPOConfig(**async_kwargs(tmp_path)))
    samples = packed_samples()
    batch = collate(samples)
    assert batch["input_ids"].shape[1] < sum(len(s["input_ids"]) for s in samples)  # the prompts were shared
    from topr_trl.asynchronous.trainer import AsyncTOPRTrainer as Mirror

    log_probs, _, _, _ = Mirror._packed_forward(trainer, trainer.model, batch)
    expected = torch.cat(reference_logps(AutoModelForCausalLM.from_pretrained(MODEL), samples))
    # packed tree attention against a plain forward per completion, both float32: FORWARD_ROUNDINGS eps of the
    # largest |log-prob| (~21 for these random completions, above the logits' ~16): a log-prob near 0 carries the
    # rounding of the logits it came from, not its own size
    assert torch.allclose(log_probs, expected, **float32_tolerance(expected, FORWARD_ROUNDINGS)), (
        (log_probs - expected).abs().max()
    )


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "global-token-mean"])
def test_async_topr_loss_equals_the_synchronous_topr_loss_on_the_same_samples(tmp_path, aggregation):
    trainer = build(AsyncTOPRTrainer, AsyncTOPRConfig(**async_kwargs(tmp_path, topr_loss_aggregation=aggregation)))
    trainer.current_gradient_accumulation_steps = 1
    samples = packed_samples()
    loss = trainer.compute_loss(trainer.model, collate(samples))
    loss.backward()
    weight = trainer.model.get_input_embeddings().weight
    gradient = weight.grad.clone()

    reference = AutoModelForCausalLM.from_pretrained(MODEL)
    logps, mask = padded(reference_logps(reference, samples))
    behaviour, _ = padded([torch.as_tensor(s["old_log_probs"][s["completion_mask"] == 1]) for s in samples])
    signal = torch.tensor([s["advantage"] for s in samples])
    kwargs = {"num_tokens": mask.sum()} if aggregation == "global-token-mean" else {}
    expected, terms = topr_loss(logps, behaviour, signal, mask, PolicyLossSpec(), aggregation, **kwargs)
    expected.backward()
    # packed against padded in float32: equal up to the rounding of a forward (the loss) and a forward and backward
    # (the gradient), relative to the largest value compared; see FORWARD_ROUNDINGS
    tolerance = float32_tolerance(expected, FORWARD_ROUNDINGS)
    assert torch.allclose(loss, expected, **tolerance), (loss.item(), expected.item())
    wanted = reference.get_input_embeddings().weight.grad
    assert torch.allclose(gradient, wanted, **float32_tolerance(wanted, BACKWARD_ROUNDINGS)), (
        gradient - wanted
    ).abs().max() / wanted.abs().max()
    # a bug stays far outside it: 1% more weight on one completion moves the loss by > 100x the tolerance
    heavier, _ = topr_loss(
        logps.detach(),
        behaviour,
        signal * torch.tensor([1.01, 1, 1, 1, 1, 1]),
        mask,
        PolicyLossSpec(),
        aggregation,
        **kwargs,
    )
    assert (heavier - expected).abs() > 100 * (tolerance["atol"] + tolerance["rtol"] * expected.abs())
    # the weights are TOPR's: positives 1, negatives pi/mu truncated at 1, and some negatives were truncated
    assert sorted(set(terms.weights[signal >= 0].flatten().tolist())) == [1.0]
    negative_weights = terms.weights[signal < 0].flatten()
    assert (negative_weights <= 1).all() and (negative_weights < 1).any()


def test_mirrored_forward_and_accounting_equal_trls_compute_loss_under_ppo_clipping(tmp_path):
    """The copy of AsyncGRPOTrainer.compute_loss's forward and step accounting, with TOPR's registry loss set to
    PPO clipping per token over the micro-batch's tokens, gives TRL's own loss, gradient and accounting."""
    batch = collate(packed_samples(seed=1))
    results = []
    for trainer_class, config in (
        (cpu_capable(AsyncGRPOTrainer), AsyncGRPOConfig(**async_kwargs(tmp_path / "g"))),
        (
            AsyncTOPRTrainer,
            AsyncTOPRConfig(
                **async_kwargs(
                    tmp_path / "t", loss_type="ppo", topr_ratio_level="token", topr_loss_aggregation="global-token-mean"
                )
            ),
        ),
    ):
        trainer = build(trainer_class, config)
        trainer.current_gradient_accumulation_steps = 2
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        accounting = [trainer._step_forward_tokens, trainer._step_trained_tokens, trainer._step_samples]
        results.append((loss.detach(), trainer.model.get_input_embeddings().weight.grad.clone(), accounting))
    (trl_loss, trl_grad, trl_accounting), (loss, grad, accounting) = results
    assert torch.allclose(loss, trl_loss, atol=1e-7) and trl_loss.abs() > 0
    assert torch.allclose(grad, trl_grad, atol=1e-7)
    assert accounting == trl_accounting


def test_a_row_with_nothing_to_train_joins_the_metrics_and_trains_nothing(tmp_path):
    """A packed row with no trained token (another rank may have some) gives a zero loss whose gradient is zero, and
    still runs the metric code, whose reductions every rank joins: returning before it would hang a multi-process
    run. Its ratio minima are +inf (no trajectory) and its branch losses NaN, left out of the mean over ranks."""
    from topr_trl.training.policy_metrics import ratio_minima

    batch = collate(packed_samples(seed=1))
    batch["token_index"] = torch.full_like(batch["token_index"], -1)
    trainer = build(AsyncTOPRTrainer, AsyncTOPRConfig(**async_kwargs(tmp_path)))
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
    logged = trainer._metrics["train"]
    assert logged["topr/positive_fraction"] and not logged["topr/loss_positive"]  # NaN: left out of the log
    empty = PolicyLossSpec()
    from topr_trl.loss import packed_topr_loss

    _, terms, mask = packed_topr_loss(
        torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long), empty
    )
    assert ratio_minima(terms, torch.zeros(0, 1), mask).tolist() == [math.inf] * 4


# ---------------------------------------------------------------------------------------------------------
# The stand-in worker
# ---------------------------------------------------------------------------------------------------------


def test_group_advantages_and_summed_rewards_follow_trls_rules():
    assert np.allclose(
        group_advantages([1.0, 0.0, math.nan, 1.0]),
        [
            (1 - 2 / 3) / (np.std([1, 0, 1]) + 1e-8),
            (0 - 2 / 3) / (np.std([1, 0, 1]) + 1e-8),
            0.0,
            (1 - 2 / 3) / (np.std([1, 0, 1]) + 1e-8),
        ],
    )
    assert summed_rewards([[1.0, None, None], [0.5, 2.0, None]])[:2] == [1.5, 2.0]
    assert math.isnan(summed_rewards([[1.0, None, None], [0.5, 2.0, None]])[2])


def test_the_worker_rules_are_trls_scoring_run_on_the_same_rewards():
    """The copies in lagged_worker (docs/copies.md) held to the scoring of TRL's rollout worker itself
    (`_AsyncRolloutLoop._score_group`), run on a view of a worker (the attributes it reads) and one group: two reward
    functions with None in each, a completion neither scores, a group with a single scored completion (std 0)."""
    import asyncio
    from types import SimpleNamespace

    from accelerate import PartialState
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, TrainingSequence, _AsyncRolloutLoop

    def trls_scoring(per_function):
        count = len(per_function[0])
        functions = [lambda column=column, **kwargs: column for column in per_function]
        worker = SimpleNamespace(
            reward_funcs=functions,
            reward_func_names=[f"f{i}" for i in range(len(functions))],
            _env_reward_types=[],
            _provides_rollout_reward=False,
        )
        group = RolloutGroup(
            prompts=["p"] * count,
            reward_kwargs={},
            completions=["c"] * count,
            completions_ids=[[1]] * count,
            tool_call_counts=[0] * count,
            tool_failure_counts=[0] * count,
            model_version=0,
            group_id=0,
            env_rewards=[None] * count,
            rollout_rewards=[None] * count,
            completions_sequences=[[TrainingSequence([1, 2], [0, 1], [0.0, -0.5], None)]] * count,
        )
        samples = asyncio.run(_AsyncRolloutLoop._score_group(worker, group))
        return [sample.metrics["reward"] for sample in samples], [sample.advantage for sample in samples]

    PartialState()  # TRL's logger asks for it
    for per_function in (
        [[1.0, None, 0.0, None, 2.5], [0.5, None, None, -1.0, 0.25]],
        [[None, 3.0, None], [None, None, None]],
    ):
        rewards, advantages = trls_scoring(per_function)
        ours = summed_rewards(per_function)
        assert np.array_equal(np.array(ours), np.array(rewards), equal_nan=True)
        assert np.array_equal(group_advantages(ours), np.array(advantages))


def take(worker, count, timeout=60.0):
    return [worker.rollout_buffer.get(timeout=timeout) for _ in range(count)]


def test_lagged_worker_samples_from_the_policy_k_versions_old():
    lag = 2
    worker = make_worker(lag=lag)
    base = {name: value.clone() for name, value in worker.model.state_dict().items()}
    versions = {}

    def publish(version):
        # every version has its own lm_head, so a sample's log-probs tell which version sampled it
        weights = {name: value.clone() for name, value in base.items()}
        weights["lm_head.weight"] = base["lm_head.weight"] * (1 + 0.3 * version)
        versions[version] = weights
        worker.receive_weights(weights)
        worker.update_model_version(version)

    publish(1)
    worker.start()
    try:
        taken = [(1, sample) for sample in take(worker, 16)]  # the version-1 step and the one read ahead
        for version in range(2, 7):
            publish(version)
            taken += [(version, sample) for sample in take(worker, 8)]
        time.sleep(0.5)
        assert worker.rollout_buffer.qsize() == 0  # lockstep: nothing beyond one step ahead
    finally:
        worker.stop()
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    for version, sample in taken:
        assert sample.model_version == max(1, version - lag)
        model.load_state_dict(versions[sample.model_version], strict=False)
        recomputed = reference_logps(
            model, [{"input_ids": sample.input_ids, "completion_mask": sample.completion_mask}]
        )[0]
        stored = torch.as_tensor(sample.old_log_probs[sample.completion_mask == 1])
        # generation (KV cache, 4 at a time) against a plain forward, float32: FORWARD_ROUNDINGS eps of the largest
        # |logit| (log-softmax rounds relative to the logits, up to ~40 with the scaled lm_head, not to the log-prob)
        logits = model(input_ids=torch.as_tensor(sample.input_ids)[None]).logits
        assert torch.allclose(recomputed, stored, **float32_tolerance(stored, FORWARD_ROUNDINGS, logits.abs().max()))


def test_lagged_worker_takes_the_set_time_per_sample_and_reports_a_failing_reward():
    worker = make_worker(lockstep=False, seconds_per_sample=0.1)
    worker.receive_weights(dict(worker.model.state_dict()))
    worker.update_model_version(1)
    started = time.time()
    worker.start()
    try:
        take(worker, 8)
        assert time.time() - started >= 0.8
    finally:
        worker.stop()

    def broken_reward(completions, **kwargs):
        raise ValueError("reward service down")

    worker = LaggedRolloutWorker(
        AutoModelForCausalLM.from_pretrained(MODEL),
        AutoTokenizer.from_pretrained(MODEL),
        make_reasoning_dataset(4),
        broken_reward,
        num_generations=2,
        max_completion_length=4,
    )
    worker.receive_weights(dict(worker.model.state_dict()))
    worker.update_model_version(1)
    worker.start()
    worker._thread.join(timeout=60)
    with pytest.raises(RuntimeError, match="reward service down"):
        worker.check_health(300)


# ---------------------------------------------------------------------------------------------------------
# Training: no sample dropped, staleness recorded, the cap as TRL's rule
# ---------------------------------------------------------------------------------------------------------


def run_ahead(tmp_path, **config):
    """Lockstep, but with two steps' samples generated ahead: from the second step on the trainer reads samples one
    version old, first."""
    worker = make_worker(samples_ahead=24)
    trainer = build(AsyncTOPRTrainer, AsyncTOPRConfig(**async_kwargs(tmp_path, max_steps=4, **config)), worker)
    trainer.train()
    return trainer, worker


def test_async_topr_keeps_every_stale_sample_and_a_cap_drops_them_as_trl_does(tmp_path):
    trainer, worker = run_ahead(tmp_path / "keep")
    assert 1 in trainer.staleness_counts and logged_values(trainer, "sample/dropped_stale_total") == []
    trained = sum(logged_values(trainer, "batch/samples_per_step"))
    read = sum(trainer.staleness_counts.values())
    assert trained == 4 * 8 and read - trained <= 8  # at most the micro-batch read ahead is not trained
    assert worker.samples_queued == read + worker.rollout_buffer.qsize()  # nothing lost
    histogram = {
        key: sum(logged_values(trainer, key))
        for entry in trainer.state.log_history
        for key in entry
        if key.startswith("sample/staleness_") and key.endswith("_total")
    }
    # TRL logs the counts in its bins (0, 1, 2to3, ...): a busy machine lets the worker run 2 or more versions ahead
    from topr_trl.asynchronous.trainer import staleness_bin

    binned = Counter()
    for staleness, count in trainer.staleness_counts.items():
        binned[f"sample/staleness_{staleness_bin(staleness)}_total"] += float(count)
    assert histogram == dict(binned)

    capped, _ = run_ahead(tmp_path / "cap", max_staleness=0)
    assert sum(logged_values(capped, "sample/dropped_stale_total")) > 0


def test_the_ratio_is_logged_by_the_staleness_each_sample_trains_at(tmp_path, monkeypatch):
    """Each sample's policy version travels with it into the packed batch (`TrajectoryVersions`) and its staleness is
    taken when it trains: every trained sample reaches the loss with a staleness, and at a learning rate that moves
    the policy the fresh ones (staleness 0: mu is the current weights) have pi/mu = 1 within float32 roundings while
    those a version old do not. Staleness taken when a sample is read (TRL's `sample/staleness_*`) mislabels some:
    the dataloader reads a micro-batch ahead, across a sync."""
    import topr_trl.asynchronous.trainer as async_trainer
    from topr_trl.asynchronous.trainer import STALENESS_BIN_NAMES, staleness_bin_index

    reached: list[int] = []
    recorded_sums = async_trainer.staleness_bin_sums

    def recording(terms, signal, mask, bins, *args, **kwargs):
        reached.extend(bins.tolist())
        return recorded_sums(terms, signal, mask, bins, *args, **kwargs)

    monkeypatch.setattr(async_trainer, "staleness_bin_sums", recording)
    trainer, _ = run_ahead(tmp_path)
    assert len(reached) == 4 * 8 and min(reached) >= 0, reached  # every trained sample, each with its staleness
    assert Counter(reached)[staleness_bin_index(1)] > 0 and Counter(reached)[staleness_bin_index(0)] > 0
    fresh, stale = (f"topr/staleness_{STALENESS_BIN_NAMES[staleness_bin_index(lag)]}" for lag in (0, 1))
    for branch in ("positive", "negative"):
        fresh_means = logged_values(trainer, f"{fresh}/ratio_{branch}/mean")
        assert fresh_means and all(abs(mean - 1) < 1e-4 for mean in fresh_means), fresh_means
    stale_means = [
        value
        for branch in ("positive", "negative")
        for value in logged_values(trainer, f"{stale}/ratio_{branch}/mean")
        if not math.isnan(value)
    ]
    assert stale_means and all(abs(mean - 1) > 1e-3 for mean in stale_means), stale_means
    # Kish's ESS fraction is 1 exactly when every ratio is equal: so at the fresh lag, and below 1 a version old
    assert all(value == pytest.approx(1.0, abs=1e-6) for value in logged_values(trainer, f"{fresh}/ratio_ess_fraction"))
    stale_ess = logged_values(trainer, f"{stale}/ratio_ess_fraction")
    assert stale_ess and all(value < 1 - 1e-6 for value in stale_ess), stale_ess
    assert not any(
        key == async_trainer.MODEL_VERSION_KEY for entry in trainer.state.log_history for key in entry
    )  # taken out before TRL's collator logs the samples' metrics


def test_staleness_bins_of_a_tensor_are_the_bins_of_each_value():
    """Against the table itself: each value's bin is the one whose [low, high] holds it."""
    from topr_trl.asynchronous.trainer import STALENESS_BINS, staleness_bin_index, staleness_bin_indices

    values = list(range(-3, 130))
    expected = [next(i for i, (low, high, _) in enumerate(STALENESS_BINS) if low <= v <= high) for v in values]
    assert staleness_bin_indices(torch.tensor(values)).tolist() == expected
    assert [staleness_bin_index(v) for v in values] == expected


def test_reward_signal_trains_on_r_minus_c(tmp_path):
    trainer = build(
        AsyncTOPRTrainer,
        AsyncTOPRConfig(**async_kwargs(tmp_path, topr_signal="reward", topr_baseline=0.25, max_steps=1)),
    )
    trainer.get_train_dataloader()  # the queue is read through `ConsumedSamples` from where TRL's dataloader is built
    source = trainer.rollout_queue

    @dataclasses.dataclass
    class Row:  # the fields of TRL's RolloutSample the queue's reader uses
        model_version: int
        metrics: dict
        advantage: float
        group_id: int = 0

    source.source.put(Row(0, {"reward": 1.0}, 0.7))
    source.source.put(Row(0, {"reward": math.nan}, 0.7))
    assert [source.get(timeout=1).advantage for _ in range(2)] == [0.75, 0.0]
    trainer.train()
    assert logged_values(trainer, "topr/effective_positive_proportion")


def test_config_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncTOPRConfig(**async_kwargs(tmp_path, max_staleness=2.5))
    with pytest.raises(ValueError, match="must be a number"):
        AsyncTOPRConfig(**async_kwargs(tmp_path, topr_signal="reward", topr_baseline="group_mean"))
    with pytest.raises(ValueError, match="loss_type"):
        AsyncTOPRConfig(**async_kwargs(tmp_path, loss_type="grpo"))
    with pytest.raises(TypeError, match="AsyncTOPRConfig"):
        build(AsyncTOPRTrainer, AsyncGRPOConfig(**async_kwargs(tmp_path)))
    config = AsyncTOPRConfig(**async_kwargs(tmp_path))
    assert config.keeps_every_sample and AsyncTOPRConfig(**async_kwargs(tmp_path, max_staleness=3)).max_staleness == 3


def test_the_trained_model_still_generates_like_the_base_model(tmp_path):
    """On a CPU the trainer's attention is the tree attention in PyTorch; without tree arguments it is SDPA, so the
    policy generates (evaluation, saving, the CLI's before/after) exactly as the model loaded on its own."""
    trainer = build(AsyncTOPRTrainer, AsyncTOPRConfig(**async_kwargs(tmp_path)))
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    batch = tokenizer(["12+5=", "905+88="], padding=True, padding_side="left", return_tensors="pt")
    plain = AutoModelForCausalLM.from_pretrained(MODEL)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert policy.config._attn_implementation == "tree_sdpa"
    with torch.no_grad():
        assert torch.allclose(policy(**batch).logits, plain(**batch).logits, atol=1e-5)
        assert torch.equal(
            policy.generate(**batch, max_new_tokens=8, do_sample=False),
            plain.generate(**batch, max_new_tokens=8, do_sample=False),
        )


# ---------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------


def test_train_command_runs_asynchronous_topr_and_saves_a_model_that_loads_anywhere(tmp_path):
    import json

    from tests.conftest import saved_model_accuracy
    from tests.launching import builtin_run_flags
    from topr_trl.commands.cli import main

    output = tmp_path / "run"
    main(
        [
            "train",
            "--asynchronous",
            "--async_lag",
            "1",
            *builtin_run_flags(
                tmp_path / "base", max_steps=3, output_dir=output, per_device_train_batch_size=8, num_generations=4
            ),
        ]
    )
    summary = json.loads((output / "topr_summary.json").read_text())
    assert summary["steps"] == 3 and summary["asynchronous"]["dropped"] == 0
    counts = {int(k): v for k, v in summary["asynchronous"]["staleness_counts"].items()}
    assert sum(counts.values()) >= 3 * 8 and max(counts) >= 1  # the lag of 1 shows up as staleness
    # the saved model loads with its ordinary attention and scores what the run reported
    assert "tree" not in json.loads((output / "config.json").read_text()).get("_attn_implementation", "")
    assert summary["after"] == saved_model_accuracy(output, 8)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--beta", "0.1"], "`beta`=0.1 has no effect on the asynchronous trainer"),
        (["--loss_type", "grpo"], "loss_type"),
        (["--async_max_staleness", "2.5"], "max_staleness"),
    ],
)
def test_train_command_refuses_what_the_asynchronous_trainer_cannot_do(tmp_path, flags, message):
    from topr_trl.commands.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["train", "--asynchronous", "--dry_run", "true", "--output_dir", str(tmp_path / "run"), *flags])


def _other_values(field_, value) -> list:
    """Candidate values of `field_`'s type other than `value`, for a run that set the field."""
    import enum

    kind = str(field_.type)
    if isinstance(value, enum.Enum):
        return [member for member in type(value) if member != value][:3]
    if isinstance(value, bool) or (value is None and "bool" in kind):
        return [not value]
    if isinstance(value, int) or (value is None and "int" in kind):
        return [(value or 0) + 1, (value or 0) + 2, 2 * (value or 8), 1, 2, 32]
    if isinstance(value, float) or (value is None and "float" in kind):
        finite = value is not None and value == value and abs(value) != float("inf")
        return [value * 2 + 0.5, value / 2] if finite else [0.5, 0.25, 1.0]
    if isinstance(value, str) or (value is None and "str" in kind):
        from topr_trl.config import AGGREGATIONS, BEHAVIOUR_SOURCES

        return [
            f"{value or ''}-set",
            "sft",
            "reward",
            "token",
            "none",
            "skip",
            "error",
            "steps",
            *AGGREGATIONS,
            *BEHAVIOUR_SOURCES,
        ]
    if isinstance(value, (list, tuple)) or (value is None and "list" in kind):
        return [["set"], [1.0], ["tensorboard"]]
    if isinstance(value, dict) or (value is None and "dict" in kind):
        return [{"set": 1}]
    return []


# Fields for which no other value builds a TOPRConfig here (they name files or services that do not exist on this
# machine, or need a GPU): not walked.
_NOT_WALKED = {
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "resume_from_checkpoint",
    "hub_token",
    "push_to_hub",
    "use_liger_kernel",
    "bf16",
    "fp16",
    "tf32",
    "use_vllm",
}
# Fields the walk finds no other accepted value for from their type alone (they need other fields set with them, or
# their value is resolved at run time); a new field that lands here is seen by the assertion below.
_NO_OTHER_VALUE_HERE = {
    "auto_find_batch_size",
    "load_best_model_at_end",
    "accelerator_config",
    "parallelism_config",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "ddp_backend",
    "log_completions_hub_repo",
    "topr_baseline_scope",
    "pad_to_multiple_of",
}  # resolved from "auto" by what earlier code set up in the process


def test_every_topr_config_field_reaches_the_asynchronous_trainer_or_stops_it(tmp_path):
    """`--asynchronous` turns the run's TOPRConfig into an AsyncTOPRConfig: each field, set to another value that
    TOPRConfig accepts, either arrives with that value or stops the conversion in one ValueError naming it; nothing
    is dropped without a word (it was: topr_negative_weight, cispo_epsilon_*, kimi15_tau, topr_check_finite,
    scale_rewards, ...)."""
    import dataclasses

    from topr_trl import TOPRConfig
    from topr_trl.asynchronous.config import async_config_from
    from topr_trl.loss import POLICY_LOSSES

    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    # a field only some losses read is set with such a loss (TOPRConfig refuses it with another)
    loss_reading = {}
    for loss_type, entry in POLICY_LOSSES.items():
        for name in entry.reads:
            loss_reading.setdefault(name, loss_type)
    reached, refused, unwalked = [], [], []
    for field_ in dataclasses.fields(TOPRConfig):
        if not field_.init or field_.name in base or field_.name in _NOT_WALKED:
            continue
        context = {
            **base,
            **({"loss_type": loss_reading[field_.name]} if field_.name in loss_reading else {}),
            **({"topr_signal": "reward"} if field_.name == "topr_target_effective_proportion" else {}),
        }
        default = TOPRConfig(**context)
        args = None
        for candidate in _other_values(field_, getattr(default, field_.name)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    args = TOPRConfig(**context, **{field_.name: candidate})
            except Exception:  # noqa: BLE001 - not a value TOPRConfig takes: try the next
                continue
            if getattr(args, field_.name) != getattr(default, field_.name):
                break
            args = None
        if args is None:
            unwalked.append(field_.name)
            continue
        value = getattr(args, field_.name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                converted = async_config_from(args)
        except ValueError as error:
            assert f"`{field_.name}`" in str(error), (field_.name, str(error))
            refused.append(field_.name)
            continue
        assert getattr(converted, field_.name, None) == value, (
            field_.name,
            value,
            getattr(converted, field_.name, "absent"),
        )
        reached.append(field_.name)
    assert {"scale_rewards", "beta"} <= set(refused)
    assert {
        "topr_check_finite",
        "learning_rate",
        "topr_signal",
        "num_generations",
        "topr_positive_weight",
        "topr_negative_weight",
        "cispo_epsilon_low",
        "cispo_epsilon_high",
        "kimi15_tau",
        "delta",
    } <= set(reached)
    print(f"reached {len(reached)}, refused {len(refused)}, not walked {unwalked}")
    assert set(unwalked) <= _NO_OTHER_VALUE_HERE, unwalked


def test_asynchronous_command_line_keeps_its_checks_and_refuses_what_would_be_dropped(tmp_path):
    from topr_trl.commands import arguments
    from topr_trl.commands.cli import main
    from topr_trl.commands.runs import _asynchronous_config

    argv = ["--asynchronous", "--output_dir", str(tmp_path / "run")]
    script_args, training_args, model_args = arguments.parse_command("train", argv)
    converted = _asynchronous_config(script_args, training_args, model_args, None)
    assert converted.topr_check_finite is True  # the command line's check reaches the asynchronous trainer
    script_args, training_args, model_args = arguments.parse_command("train", [*argv, "--topr_negative_weight", "0.5"])
    assert _asynchronous_config(script_args, training_args, model_args, None).policy_loss_spec.negative_weight == 0.5
    with pytest.raises(SystemExit, match="`scale_rewards`='none' is not read by the asynchronous trainer"):
        main(["train", *argv, "--scale_rewards", "none", "--dry_run", "true"])
    with pytest.raises(SystemExit, match="`topr_unscored_batch`='error' is not read"):
        main(["train", *argv, "--topr_unscored_batch", "error", "--dry_run", "true"])


@pytest.mark.parametrize(
    "knobs",
    [
        dict(topr_negative_weight=0.5, topr_positive_weight=2.0),
        dict(loss_type="cispo_two_sided", cispo_epsilon_low=0.3, cispo_epsilon_high=0.05),
        dict(loss_type="kimi15", kimi15_tau=0.7),
        dict(loss_type="ppo", delta=1.25),
    ],
)
def test_the_loss_knobs_are_declared_once_and_reach_the_asynchronous_loss(knobs, tmp_path):
    """Each loss knob set on the asynchronous config gives the spec the synchronous config gives (one declaration,
    one `policy_loss_spec_of`), and the packed loss the asynchronous trainer computes moves with it: on the same
    packed batch the loss with the knob differs from the loss with the default."""
    import dataclasses

    from topr_trl import TOPRConfig
    from topr_trl.asynchronous import AsyncTOPRConfig
    from topr_trl.loss import packed_topr_loss

    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    asynchronous = AsyncTOPRConfig(**common, **knobs).policy_loss_spec
    assert asynchronous == TOPRConfig(**common, **knobs).policy_loss_spec
    default = AsyncTOPRConfig(**common, loss_type=knobs.get("loss_type", "topr")).policy_loss_spec
    assert (
        asynchronous != default
        and dataclasses.replace(
            default, **{f.name: getattr(asynchronous, f.name) for f in dataclasses.fields(asynchronous)}
        )
        == asynchronous
    )
    generator = torch.Generator().manual_seed(0)
    logps = (-torch.rand(12, generator=generator)).requires_grad_()
    behaviour = logps.detach() + torch.randn(12, generator=generator)  # ratios on both sides of every clip
    segment = torch.tensor([0] * 3 + [1] * 4 + [2] * 2 + [3] * 3)
    signal = torch.tensor([1.0, -1.0, 1.0, -1.0])[segment]
    with_knob, _, _ = packed_topr_loss(logps, behaviour, signal, segment, asynchronous)
    without, _, _ = packed_topr_loss(logps, behaviour, signal, segment, default)
    assert not torch.allclose(with_knob, without)


def test_a_knob_the_asynchronous_loss_does_not_read_is_refused(tmp_path):
    from topr_trl.asynchronous import AsyncTOPRConfig

    with pytest.raises(ValueError, match="`kimi15_tau` has no effect with loss_type='topr'.*'kimi15'"):
        AsyncTOPRConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", kimi15_tau=0.5)
    with pytest.raises(ValueError, match="`topr_negative_weight` must be a finite number >= 0"):
        AsyncTOPRConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none", topr_negative_weight=-1.0)


@pytest.mark.parametrize("truncation", [{"top_k": 2}, {"top_p": 0.8}, {"min_p": 0.2}])
def test_a_worker_sampling_with_truncation_gives_pi_over_mu_of_one_at_learning_rate_zero(truncation, tmp_path):
    """The CPU worker samples with top-k, top-p or min-p (its `generation_kwargs`) and says so (`sampling`); the trainer
    scores pi on that support from the packed forward's hidden states, for the negatives (canonical TOPR pins the
    positives' weight, so theirs is neither scored nor reported), so at learning rate 0 and lag 0 every ratio is 1
    within 1e-4."""
    worker = make_worker(generation_kwargs=truncation)
    assert worker.sampling.truncates
    trainer = build(
        AsyncTOPRTrainer,
        AsyncTOPRConfig(
            **async_kwargs(tmp_path, learning_rate=0.0, max_steps=2, topr_signal="reward", topr_baseline=0.5)
        ),
        worker,
    )
    trainer.train()
    ratios = ratio_extremes(trainer.state.log_history)
    assert ratios and all(abs(ratio - 1) < 1e-4 for ratio in ratios), ratios
    assert trainer._sampler_processing == worker.sampling
    assert not logged_values(trainer, "topr/ratio_positive/mean")  # not scored: not reported
    assert logged_values(trainer, "topr/ratio_ess_fraction") and all(
        value == pytest.approx(1.0, abs=1e-6) for value in logged_values(trainer, "topr/ratio_ess_fraction")
    )


# ---------------------------------------------------------------------------------------------------------
# A stopped run resumes where its checkpoint's steps stopped training
# ---------------------------------------------------------------------------------------------------------


def test_a_stopped_asynchronous_run_resumes_at_the_first_untrained_prompt_and_trains_each_once(tmp_path, monkeypatch):
    """Stopped after step 3 with a checkpoint at step 2, the run resumes at the first prompt group its first two
    steps did not train, and the two runs together train prompts 0-7 once each (4 samples apiece). TRL's own rule
    (the first group missing from `_trained_groups`, filled when a micro-batch is collated, one ahead of training)
    would have skipped the groups read ahead at the checkpoint. The resumed run says in one line what the stop left
    behind: the samples generated and not trained, which it generates again."""
    import json

    from transformers import TrainerCallback

    import topr_trl.asynchronous.trainer as async_trainer

    config = dict(max_steps=4, save_strategy="steps", save_steps=2)
    first = build(AsyncTOPRTrainer, AsyncTOPRConfig(**async_kwargs(tmp_path, **config)), make_worker(samples_ahead=24))
    at_checkpoint = {}

    class AtCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            at_checkpoint[state.global_step] = (Counter(first.rollout_ledger.trained), set(first._trained_groups))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt  # a stop between checkpoints

    first.add_callback(AtCheckpoint())
    with pytest.raises(KeyboardInterrupt):
        first.train()
    trained, collated = at_checkpoint[2]
    assert trained == Counter(dict.fromkeys(range(4), 4))  # two steps of 8 samples: groups 0-3, whole
    assert max(collated) + 1 > 4  # TRL's count: the micro-batch read ahead, never trained before the stop
    state = json.loads((tmp_path / "checkpoint-2" / "rollout_state.json").read_text())
    assert state["prompt_index"] == 4 and state["samples_trained_again"] == 0 and state["samples_left_behind"] > 0

    said = []
    monkeypatch.setattr(async_trainer.logger, "warning", lambda message, *a, **k: said.append(str(message)))
    worker = make_worker(samples_ahead=24)
    second = build(AsyncTOPRTrainer, AsyncTOPRConfig(**async_kwargs(tmp_path, **config)), worker)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert second.state.global_step == 4 and worker.start_prompt == 4
    resumed = Counter({worker.start_prompt + group: count for group, count in second.rollout_ledger.trained.items()})
    assert resumed == Counter(dict.fromkeys(range(4, 8), 4))  # prompts 4-7, each group whole, once
    assert [line for line in said if line.startswith("resuming from")] == [
        async_trainer.describe_resume(tmp_path / "checkpoint-2", state)
    ]
    assert f"{state['samples_left_behind']} samples generated before the stop and not trained" in said[-1]


def test_the_worker_resumed_at_a_prompt_samples_the_rows_the_whole_run_would_have():
    """Prompt order by position: a worker resumed at prompt 13 of 16 rows takes the rows the run from 0 takes at
    positions 13, 14, 15 (the first pass) and 16, 17 (the second pass's shuffle), with group ids from 0."""
    whole, resumed = make_worker(lockstep=False), make_worker(lockstep=False)
    order = [whole._next_row()[1] for _ in range(18)]
    resumed.resume_at(13, model_version=0)
    assert [resumed._next_row() for _ in range(5)] == list(enumerate(order[13:18]))
    assert sorted(order[:16]) == list(range(16))  # a pass takes every row once


def test_the_resume_position_passes_dropped_groups_and_stops_at_a_split_one():
    """The ledger by hand: group 1 dropped by the staleness cap does not pin the position (TRL issue #7274); group 4
    trained in half stops it there, its 2 trained samples trained again; a micro-batch collated and not trained
    (read ahead) counts as left behind, as do the samples read and not collated."""
    from topr_trl.asynchronous.resume import ResumePosition, RolloutLedger

    ledger = RolloutLedger()
    for group in range(6):
        for _ in range(4):
            ledger.record_read(group, dropped=group == 1)
    for batch in ([0, 0, 0, 0, 2, 2, 2, 2], [3, 3, 3, 3, 4, 4], [4, 4, 5, 5]):
        ledger.record_collated(batch)
    ledger.record_trained_micro_batch()
    ledger.record_trained_micro_batch()
    assert ledger.resume_position(4) == ResumePosition(group=4, left_behind=24 - 14 - 4, trained_again=2)
    ledger.record_trained_micro_batch()
    assert ledger.resume_position(4) == ResumePosition(group=5, left_behind=2, trained_again=2)


def test_the_documented_python_path_without_a_server_runs_as_written(tmp_path, monkeypatch, capfd):
    """docs/asynchronous.md's block under "Without a server", run as it is written with `model`, `prompts` and
    `my_reward` a user's: before, `token_budget` unset made TRL wait 240 s for a vLLM server, then time out. The
    trainer runs on a derived config; the user's is left as written."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "asynchronous.md").read_text()
    section = page.split("## Without a server", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace = {"model": MODEL, "prompts": make_reasoning_dataset(8), "my_reward": reasoning_reward}
    started = time.monotonic()
    exec(compile(block, "docs/asynchronous.md", "exec"), namespace)  # noqa: S102 - the page's own code
    assert namespace["trainer"].state.global_step == 2
    assert namespace["trainer"].args.token_budget == 0 and time.monotonic() - started < 120
    assert namespace["args"].token_budget is None
    printed = capfd.readouterr().err
    # TRL's duplicate-callback notice (the list of every callback) and transformers' deprecations of TRL's names
    assert "there is already one" not in printed and "gradient_checkpointing" not in printed
