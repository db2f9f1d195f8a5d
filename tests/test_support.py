"""pi on the support mu sampled from (`topr_trl.support`): the support against transformers' own warpers and an
independent sorted reference, hand-computed processed log-probs, the head held to TRL's fused log-probs, only the
sequences whose weight reads pi/mu scored, and pi/mu = 1 at learning rate 0 when mu truncated (top-k, top-p) on the
offline and online transformers paths (tests/test_vllm.py: the vLLM ones)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.offline import generate_offline_dataset, stored_reward
from topr_trl.support import SamplerProcessing, processed_log_probs
from topr_trl.support.rule import descending_groups, scaled_logits, support_length
from topr_trl.support.scoring import captured_outputs, completion_processed_log_probs, fused_head_parts, head_projection

from .conftest import float32_tolerance, parity_reward, ratio_extremes, small_config_kwargs


def sampler_support(logits: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """The tokens the rule keeps, (N, V) bool: the first `support_length` of each row in the order of one sort (where
    the cut falls among tied logits, which of them are kept is that sort's order, as in the engines)."""
    scaled = scaled_logits(logits, processing.temperature)
    descending, order = scaled.sort(dim=-1, descending=True)
    kept = torch.arange(scaled.size(-1)) < support_length(descending, processing).unsqueeze(-1)
    return torch.zeros_like(kept).scatter(-1, order, kept)


def head_logits(owner: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The policy's logits as the trainer's scoring projects them (`head_projection`), in float32."""
    with head_projection(owner) as project:
        return project(hidden).float()


WARPERS = {
    "top_k": lambda s: TopKLogitsWarper(s.top_k),
    "top_p": lambda s: TopPLogitsWarper(s.top_p),
    "min_p": lambda s: MinPLogitsWarper(s.min_p),
}


def transformers_support(logits: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """The tokens transformers' generation keeps: its warpers, in its order, on logits / T (an independent
    implementation of `sampler_support` for the transformers engine)."""
    scores = logits / processing.temperature
    for name in ("top_k", "top_p", "min_p"):
        if getattr(processing, name):
            scores = WARPERS[name](processing)(None, scores)
    return torch.isfinite(scores)


@pytest.mark.parametrize(
    "processing",
    [
        SamplerProcessing(top_k=3),
        SamplerProcessing(top_p=0.9),
        SamplerProcessing(temperature=0.7, top_k=5, top_p=0.8),
        SamplerProcessing(min_p=0.2),
        SamplerProcessing(top_k=10, top_p=0.5, min_p=0.1),
        SamplerProcessing(top_k=1),
    ],
)
def test_the_support_is_the_one_transformers_generation_samples_from(processing):
    """Random logits over 50 tokens (rows of wide and of peaked distributions), plus a row of ties at the k-th value,
    which both engines keep."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=generator) * torch.linspace(0.3, 6, 64).unsqueeze(1)
    logits[0, :8] = 4.0  # eight ties at the top
    assert_same_support(sampler_support(logits, processing), transformers_support(logits, processing), logits)


def assert_same_support(kept: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor) -> None:
    """Two supports are the same: the same tokens, except that where top-p's cut falls among tied logits, which of
    the ties it keeps is the order of a sort (not the same in two sorts), so only as many of them."""
    assert torch.equal(kept.sum(-1), expected.sum(-1))
    ascending, order = logits.sort(dim=-1)
    repeats = ascending[:, 1:] == ascending[:, :-1]
    tied = torch.zeros_like(ascending, dtype=torch.bool)
    tied[:, 1:] |= repeats
    tied[:, :-1] |= repeats
    tied = tied.scatter(-1, order, tied)  # a logit another token of its row has as well
    assert not bool(((kept != expected) & ~tied).any())


def test_vllm_applies_min_p_before_top_p():
    """One distribution, two orders. Probabilities (0.4, 0.3, 0.2, 0.1), top_p 0.75, min_p 0.4:
    transformers keeps top-p's nucleus (ascending mass 0.1 <= 0.25 removes only the last token), then min-p relative to
    the renormalised largest (0.2 / 0.9 >= 0.4 * 0.4 / 0.9) keeps three; vLLM first removes 0.1 < 0.4 * 0.4 by min-p,
    then top-p on the renormalised (4, 3, 2) / 9 removes 2/9 <= 0.25: two. transformers' own warpers agree."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    transformers_order = SamplerProcessing(top_p=0.75, min_p=0.4)
    assert sampler_support(logits, transformers_order).tolist() == [[True, True, True, False]]
    assert transformers_support(logits, transformers_order).tolist() == [[True, True, True, False]]
    vllm_order = SamplerProcessing(top_p=0.75, min_p=0.4, engine="vllm")
    assert sampler_support(logits, vllm_order).tolist() == [[True, True, False, False]]
    tokens = torch.tensor([0])
    assert processed_log_probs(logits, tokens, transformers_order).item() == pytest.approx(math.log(0.4 / 0.9))
    assert processed_log_probs(logits, tokens, vllm_order).item() == pytest.approx(math.log(0.4 / 0.7))


def test_processed_log_probs_by_hand():
    """Logits (2, 1, 0, -1), top-k 2: the kept tokens are 0 and 1. A sampled token outside the support (3, which mu
    gave weight only before the policy moved) is kept with it rather than given log 0."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2)
    got = processed_log_probs(logits, torch.tensor([0, 3]), SamplerProcessing(top_k=2))
    expected = [2 - math.log(math.exp(2) + math.exp(1)), -1 - math.log(math.exp(2) + math.exp(1) + math.exp(-1))]
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    # top-p 0.7 at temperature 2: probabilities softmax(1, .5, 0, -.5) = .444 .269 .163 .099; ascending cumulative
    # mass .099 .263 .531 1: the first two are <= 0.3, removed
    got = processed_log_probs(logits[:1], torch.tensor([1]), SamplerProcessing(temperature=2.0, top_p=0.7))
    assert got.item() == pytest.approx(0.5 - math.log(math.exp(1) + math.exp(0.5)), rel=1e-6)


def support_correction(logits, tokens, processing, trainer_temperature):
    """log pi_S(y) - log pi_T'(y): what scoring on the support adds to the trainer's whole-vocabulary log-prob."""
    full = logits / trainer_temperature
    full_log_prob = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - full.logsumexp(dim=-1)
    return processed_log_probs(logits, tokens, processing) - full_log_prob


def test_the_correction_is_the_kept_mass_and_zero_without_truncation():
    generator = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(16, 30, generator=generator), torch.randint(0, 30, (16,), generator=generator)
    # the same logsumexp over the vocabulary in another order (sorted): a few roundings of values ~3
    assert support_correction(logits, tokens, SamplerProcessing(), 1.0).abs().max() < 1e-6
    processing = SamplerProcessing(top_k=30)  # keeps everything
    assert support_correction(logits, tokens, processing, 1.0).abs().max() < 1e-6
    top5 = SamplerProcessing(top_k=5)
    kept = torch.where(sampler_support(logits, top5), logits.softmax(-1), 0.0).sum(-1)
    in_support = sampler_support(logits, top5).gather(1, tokens.unsqueeze(1)).squeeze(1)
    expected = -kept.log()
    got = support_correction(logits, tokens, top5, 1.0)
    assert torch.allclose(got[in_support], expected[in_support], rtol=1e-5)
    # at another temperature T, the correction also carries log softmax(z / T) - log softmax(z)
    warm = SamplerProcessing(temperature=0.5)
    exact = (logits / 0.5).log_softmax(-1) - logits.log_softmax(-1)
    assert torch.allclose(
        support_correction(logits, tokens, warm, 1.0), exact.gather(1, tokens.unsqueeze(1)).squeeze(1), atol=1e-5
    )


# A tiny decoder's shape: 97 tokens, width 32, 4 attention heads over 2 key-value heads.
TINY_SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def tiny_causal_lm(model_class, config_class, **config):
    """A random-init `model_class` of TINY_SHAPE, its config class given `config` too."""
    return model_class(config_class(**TINY_SHAPE, **config))


@pytest.mark.parametrize("family", ["qwen2_tied", "gemma2_softcapped"])
def test_the_head_is_the_one_trls_fused_log_probs_use(family):
    """The mirror of TRL's fused head: log-softmax(head_logits / T) at the labels equals TRL's fused log-probs
    (float32, relative to their size: the same matmul in another tiling), for a tied Qwen2 and a soft-capped Gemma2."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    if family == "qwen2_tied":
        model = tiny_causal_lm(Qwen2ForCausalLM, Qwen2Config, num_hidden_layers=2, tie_word_embeddings=True)
    else:
        model = tiny_causal_lm(
            Gemma2ForCausalLM, Gemma2Config, num_hidden_layers=2, head_dim=8, final_logit_softcapping=3.0
        )
        assert model.config.final_logit_softcapping == 3.0
    add_fused_lm_head(model, temperature=0.7)
    input_ids = torch.randint(0, 97, (3, 9))
    labels = input_ids.clone()
    backbone, owner = fused_head_parts(model)
    with torch.no_grad(), captured_outputs(backbone) as captured:
        fused = model(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs
    hidden = captured.hidden
    logits = head_logits(owner, hidden[0][:, :-1])
    ours = (logits / 0.7).log_softmax(-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ours, fused, rtol=1e-5, atol=1e-6), (ours - fused).abs().max()
    # and without truncation at the same temperature the processed log-probs are TRL's on every completion token
    processed = completion_processed_log_probs(
        owner, hidden[0], input_ids, torch.ones_like(input_ids), 4, SamplerProcessing(temperature=0.7)
    )
    assert torch.allclose(processed, fused[:, -4:], rtol=1e-5, atol=1e-6)


def test_under_autocast_the_head_projects_in_trls_dtype():
    """Under bf16 autocast (what accelerate wraps a mixed-precision forward in), TRL's fused head rounds every logit
    to bf16 before its float32 log-softmax; pi's support is scored outside that forward. `CapturedBackbone.head_dtype`
    carries the forward's dtype to the projection, so the processed log-probs without truncation are TRL's fused
    log-probs up to float32 rounding (the same bf16 products; a log-softmax over 97 tokens), while the float32
    projection an earlier version made is off by the bf16 rounding of the logits (0.12 here), over 100 times more."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = tiny_causal_lm(Qwen2ForCausalLM, Qwen2Config, num_hidden_layers=2, tie_word_embeddings=True)
    with torch.no_grad():  # logits of a few units, as a trained model's: bf16 rounds them by up to 2^-8 of that
        model.get_output_embeddings().weight.mul_(50)
    add_fused_lm_head(model, temperature=1.0)
    input_ids = torch.randint(0, 97, (3, 9))
    backbone, owner = fused_head_parts(model)
    with torch.no_grad(), captured_outputs(backbone) as captured:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused = model(input_ids=input_ids, labels=input_ids.clone(), fused_lm_head=True).log_probs[:, -4:]
    assert captured.head_dtype() == torch.bfloat16 and captured.head_dtype(cast_lm_head_to_fp32=True) == torch.float32
    ones = torch.ones_like(input_ids)
    ours = completion_processed_log_probs(
        owner, captured.hidden[0], input_ids, ones, 4, SamplerProcessing(), captured.head_dtype()
    )
    float32 = completion_processed_log_probs(owner, captured.hidden[0], input_ids, ones, 4, SamplerProcessing())
    scale = fused.abs().max().item()
    torch.testing.assert_close(ours, fused, **float32_tolerance(fused, roundings=16, scale=scale))
    assert (float32 - fused).abs().max() > 100 * float32_tolerance(fused, roundings=16, scale=scale)["atol"]


@pytest.fixture(scope="module")
def truncated_samples(tiny_model_path, arithmetic_dataset, tmp_path_factory):
    """The policy's own samples at top-k 3 and top-p 0.9 (mu = the policy's processed distribution): the tiny model
    is random-initialised, near uniform over its vocabulary, so the kept mass per token is small."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    datasets = {}
    for name, sampling in {"top_k": dict(top_k=3), "top_p": dict(top_p=0.9)}.items():
        torch.manual_seed(0)
        datasets[name] = generate_offline_dataset(
            model,
            tokenizer,
            arithmetic_dataset.select(range(4)),
            parity_reward,
            tmp_path_factory.mktemp(name),
            num_completions=4,
            max_new_tokens=6,
            prompts_per_shard=4,
            prompts_per_batch=4,
            show_progress=False,
            **sampling,
        )
    return datasets


def ratios_at_learning_rate_zero(trainer) -> list[float]:
    trainer.train()
    return ratio_extremes(trainer.state.log_history)


@pytest.mark.parametrize("truncation", ["top_k", "top_p"])
def test_replayed_truncated_samples_give_a_ratio_of_one_at_learning_rate_zero(
    truncation, truncated_samples, tiny_model_path, tmp_path
):
    """The rows store how mu sampled (`behaviour_sampling`): pi is scored on that support, so pi/mu = 1 (1e-4) with
    the trainer's own settings left at TRL's defaults (top_k 0, top_p 1). Without it the ratio is the kept mass
    multiplied over the completion's tokens (checked: far below 1)."""
    data = truncated_samples[truncation]
    assert data[0]["behaviour_sampling"][truncation] == {"top_k": 3, "top_p": 0.9}[truncation]
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=-1, per_device_train_batch_size=8, learning_rate=0.0))
    ratios = ratios_at_learning_rate_zero(
        TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=data)
    )
    assert ratios and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios), ratios
    unsaid = data.remove_columns("behaviour_sampling")  # the trainer then assumes its own (untruncated) settings
    ratios = ratios_at_learning_rate_zero(
        TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=unsaid)
    )
    assert max(ratios) < 0.9, ratios


@pytest.mark.parametrize("truncation", ["top_k", "top_p"])
def test_a_branch_whose_ratio_is_not_read_is_absent_from_the_log_not_null(
    truncation, truncated_samples, tiny_model_path, tmp_path
):
    """Under top-k/top-p replay TOPR reads no positive's ratio (its weight is 1 whatever pi/mu is), so pi is not
    scored on mu's support for them and their ratio statistics have nothing to report: `log_history` holds no
    `topr/ratio_positive/*` key, where it held a None at every step; the negatives' are logged."""
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=-1, per_device_train_batch_size=8, learning_rate=0.0))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=truncated_samples[truncation]
    )
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert steps and all(
        value is not None for entry in steps for key, value in entry.items() if key.startswith("topr/")
    )
    assert not [key for entry in steps for key in entry if key.startswith("topr/ratio_positive/")]
    assert any("topr/ratio_negative/mean" in entry for entry in steps)


def test_rows_sampled_two_ways_are_refused_in_one_line(truncated_samples, tiny_model_path, tmp_path):
    from datasets import concatenate_datasets

    other_prompts = truncated_samples["top_p"].map(lambda row: {"prompt_index": row["prompt_index"] + 100})
    mixed = concatenate_datasets([truncated_samples["top_k"], other_prompts])
    args = TOPRConfig(**small_config_kwargs(tmp_path, learning_rate=0.0))
    with pytest.raises(ValueError, match=r"sampled in 2 ways \(`behaviour_sampling`"):
        TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=mixed)


def test_online_generation_with_top_k_scores_pi_on_its_support(tiny_model_path, arithmetic_dataset, tmp_path):
    """Online (transformers generation) with top_k 3 and two optimiser steps per generation, so mu is the policy's
    log-probs at generation time: both are scored on the top-3 support (the processing is transformers'), and at
    learning rate 0 the ratio is 1."""
    args = TOPRConfig(**small_config_kwargs(tmp_path, learning_rate=0.0, top_k=3, steps_per_generation=2, max_steps=2))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    assert trainer._sampler_processing == SamplerProcessing(top_k=3, top_p=1.0, engine="transformers")
    ratios = ratios_at_learning_rate_zero(trainer)
    assert ratios and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios), ratios


def test_on_policy_without_kl_the_support_is_not_scored_and_training_is_the_same(
    tiny_model_path, arithmetic_dataset, tmp_path, monkeypatch
):
    """On-policy (GRPO keeps no log-probs from generation time, mu is this forward's own) and without KL, pi/mu is 1
    whatever the support: the trainer skips the extra pass through the output layer, and two optimiser steps give
    bitwise the parameters of the same run forced to score every sequence (a constant added to log pi moves no
    gradient). With a step per generation more, mu is the policy at generation time and the support is scored."""
    import topr_trl.trainer as trainer_module

    calls = []
    scored = trainer_module.completion_processed_log_probs
    monkeypatch.setattr(
        trainer_module, "completion_processed_log_probs", lambda *a, **k: calls.append(1) or scored(*a, **k)
    )

    def trained(name, **overrides):
        torch.manual_seed(0)
        args = TOPRConfig(**small_config_kwargs(tmp_path / name, **{"top_k": 3, "max_steps": 2, **overrides}))
        trainer = TOPRTrainer(
            model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
        )
        trainer.train()
        return [parameter.detach().clone() for parameter in trainer.model.parameters()]

    skipped = trained("skipped")
    assert calls == []
    with monkeypatch.context() as forced:
        forced.setattr(
            TOPRTrainer,
            "_rows_reading_the_ratio",
            lambda self, signal, on_policy: torch.ones(signal.numel(), dtype=torch.bool),
        )
        scored_run = trained("scored")
    assert len(calls) == 2  # one loss call per step
    assert all(torch.equal(a, b) for a, b in zip(skipped, scored_run, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(skipped, trained("start", learning_rate=0.0), strict=True))
    calls.clear()
    trained("off_policy", steps_per_generation=2)
    assert len(calls) > 2  # the generation-time log-probs and every loss call


def test_the_log_probs_in_chunks_equal_the_log_probs_at_once(monkeypatch):
    """Three tokens per chunk (the last one short) against every token at once: the same values, in order, up to
    the float32 rounding of another row blocking in the head's matmul (bitwise equal on Intel AVX-512, one ulp apart
    on AMD Zen 4 with the same torch build)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import topr_trl.support.scoring as support

    torch.manual_seed(0)
    model = tiny_causal_lm(Qwen2ForCausalLM, Qwen2Config, num_hidden_layers=1)
    hidden, tokens = torch.randn(11, 32), torch.randint(0, 97, (11,))
    processing = SamplerProcessing(top_k=4, top_p=0.8)
    at_once = support.chunked_processed_log_probs(model, hidden, tokens, processing)
    monkeypatch.setattr(support, "CORRECTION_CHUNK_ELEMENTS", 97 * 3)
    chunked = support.chunked_processed_log_probs(model, hidden, tokens, processing)
    logits = head_logits(model, hidden)
    # The head's 32-term dot products summed in another blocking (at most log2(32) = 5 roundings relative to the
    # largest logit), then the log-softmax over the kept tokens (max, subtract, exp, a sum of at most 4, log: 4 more
    # relative to the log-prob); 16 leaves room for both. A wrong chunk boundary, order or token moves a value by
    # the gap between two tokens' log-probs, 10^4 times more.
    scale = max(at_once.abs().max().item(), logits.abs().max().item())
    torch.testing.assert_close(chunked, at_once, **float32_tolerance(at_once, roundings=16, scale=scale))
    full = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (at_once <= 0).all() and (at_once > full + 0.1).all()  # over a few kept tokens, not 97


def test_the_trainer_adds_a_constant_to_log_pi_and_keeps_grpos_gradient(tiny_model_path, arithmetic_dataset, tmp_path):
    """TOPRTrainer at top_k 3: its log-probs are TRL's plus the correction, recomputed here independently from the
    model's plain logits (no fused head, no hook), and the gradient of their sum is TRL's (the correction carries
    none)."""
    args = TOPRConfig(**small_config_kwargs(tmp_path, top_k=3))
    trainer = TOPRTrainer(
        model=tiny_model_path, reward_funcs=parity_reward, args=args, train_dataset=arithmetic_dataset
    )
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, trainer.model.config.vocab_size, (3, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -2:] = 0  # a padded completion: 0 there, as TRL gives
    processing = trainer._sampler_processing
    assert processing == SamplerProcessing(top_k=3, top_p=1.0, engine="transformers")

    def logps_and_gradient(processing):
        trainer.model.zero_grad()
        trainer._sampler_processing = processing
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 4)[0]
        logps.sum().backward()
        return logps.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    corrected, corrected_grads = logps_and_gradient(processing)
    plain, plain_grads = logps_and_gradient(None)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -5:-1].float()
    tokens = input_ids[:, -4:]
    expected = processed_log_probs(logits, tokens, processing) - (logits / args.temperature).log_softmax(-1).gather(
        -1, tokens.unsqueeze(-1)
    ).squeeze(-1)
    expected = expected * attention_mask[:, -4:]
    assert torch.allclose(corrected - plain, expected, atol=1e-5), (corrected - plain, expected)
    assert (expected[attention_mask[:, -4:].bool()] > 0.1).all()  # the kept mass of 3 tokens is well below 1
    assert all(torch.equal(a, b) for a, b in zip(corrected_grads, plain_grads, strict=True))


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "csv"])
def test_behaviour_sampling_travels_through_the_files_a_user_keeps(suffix, truncated_samples, tmp_path):
    """A generated dataset written to JSON lines, Parquet or CSV (where the record is JSON text) and loaded back by
    `load_offline_source` still says how mu sampled: the trainer reads the same processing from it."""
    import json

    from topr_trl.offline import load_offline_source
    from topr_trl.offline.schema import stored_processing

    data = truncated_samples["top_k"].select_columns(
        ["prompt", "completion_ids", "behaviour_logps", "behaviour_sampling", "reward"]
    )
    path = tmp_path / f"data.{suffix}"
    if suffix == "csv":
        data.map(
            lambda row: {
                key: json.dumps(row[key]) for key in ("completion_ids", "behaviour_logps", "behaviour_sampling")
            }
        ).to_csv(str(path))
    else:
        getattr(data, "to_json" if suffix == "jsonl" else "to_parquet")(str(path))
    loaded = load_offline_source(str(path))
    assert stored_processing([loaded], SamplerProcessing()) == SamplerProcessing(top_k=3, top_p=1.0)


@pytest.mark.parametrize(
    "processing",
    [
        SamplerProcessing(top_k=3),
        SamplerProcessing(top_k=50),
        SamplerProcessing(top_p=0.9),
        SamplerProcessing(top_p=0.3),
        SamplerProcessing(min_p=0.05),
        SamplerProcessing(temperature=0.7, top_k=40, top_p=0.8),
        SamplerProcessing(top_k=20, min_p=0.2),
        SamplerProcessing(top_p=0.95, min_p=0.01, engine="vllm"),
    ],
)
def test_the_log_probs_are_the_log_softmax_over_transformers_support(processing):
    """`processed_log_probs` (top-k on the k largest logits, the other filters on the sorted row) against log-softmax
    over transformers' own support (plus the sampled token) on a 2,000-token vocabulary, with flat rows, peaked rows,
    rows of ties at the top, and sampled tokens inside and outside the support. float32 logsumexps of one support in two
    orders: within 2e-5 of values up to ~10."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(48, 2000, generator=generator) * torch.linspace(0.05, 8, 48).unsqueeze(1)
    logits[:4, :60] = 5.0  # 60 ties at the top
    tokens = torch.cat(
        [
            logits[:24].argsort(-1, descending=True)[:, 1],  # inside most supports
            torch.randint(0, 2000, (24,), generator=generator),
        ]
    )  # mostly outside
    if processing.engine == "transformers":
        keep = transformers_support(logits, processing)
    else:
        keep = sampler_support(logits, processing)
    expected = log_softmax_on_support(logits / processing.temperature, keep, tokens)
    assert torch.allclose(processed_log_probs(logits, tokens, processing), expected, atol=2e-5)


def log_softmax_on_support(scaled: torch.Tensor, keep: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log-softmax of each row's sampled token over the support plus that token; a sampled token tied with a kept
    logit but cut (the ties' order is a sort's) takes a kept tie's place, as the sampler kept it."""
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    cut_below = chosen < scaled.masked_fill(~keep, math.inf).amin(-1)
    keep = keep | (torch.nn.functional.one_hot(tokens, scaled.size(-1)).bool() & cut_below.unsqueeze(-1))
    return chosen - scaled.masked_fill(~keep, -math.inf).logsumexp(-1)


@pytest.mark.parametrize(
    "processing",
    [
        SamplerProcessing(top_k=3),
        SamplerProcessing(top_p=0.9),
        SamplerProcessing(min_p=0.05),
        SamplerProcessing(temperature=0.7, top_k=40, top_p=0.8),
        SamplerProcessing(top_p=0.95, min_p=0.01, engine="vllm"),
    ],
)
def test_bf16_logits_give_bitwise_the_log_probs_of_their_float32_copy(processing):
    """Under mixed precision the head's logits arrive in bf16: every value is converted before any arithmetic, so
    the log-probs are bit for bit those of the float32 copy (bf16 makes ties common)."""
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(48, 2000, generator=generator) * torch.linspace(0.05, 8, 48).unsqueeze(1)).bfloat16()
    tokens = torch.randint(0, 2000, (48,), generator=generator)
    assert torch.equal(
        processed_log_probs(logits, tokens, processing), processed_log_probs(logits.float(), tokens, processing)
    )


def reference_log_prob(row: list[float], token: int, processing: SamplerProcessing) -> float:
    """An independent reference for one row, in float64 Python: the filters in the generator's order, each as the
    engines write it on what the previous ones kept (top-k the k largest and their ties; top-p: sort ascending,
    remove the tokens whose cumulative probability is <= 1 - p, keep the largest; min-p: probability >= min_p times
    the largest), then the log-softmax of the sampled token over what is kept plus that token (unless it ties the
    smallest kept logit: then it is one of the ties kept)."""
    scaled = [value / processing.temperature for value in row]
    kept = list(range(len(scaled)))
    for name in {"transformers": ("top_k", "top_p", "min_p"), "vllm": ("min_p", "top_k", "top_p")}[processing.engine]:
        values = sorted((scaled[i] for i in kept), reverse=True)
        if name == "top_k" and processing.top_k and processing.top_k < len(kept):
            kept = [i for i in kept if scaled[i] >= values[processing.top_k - 1]]
        elif name == "top_p" and processing.top_p is not None and processing.top_p < 1:
            largest = values[0]
            total = sum(math.exp(v - largest) for v in values)
            ascending = sorted(kept, key=lambda i: scaled[i])
            cumulative, removed = 0.0, set()
            for i in ascending[:-1]:
                cumulative += math.exp(scaled[i] - largest) / total
                if cumulative <= 1 - processing.top_p:
                    removed.add(i)
            kept = [i for i in kept if i not in removed]
        elif name == "min_p" and processing.min_p:
            largest = values[0]
            kept = [i for i in kept if math.exp(scaled[i] - largest) >= processing.min_p]
    # a sampled token cut among ties of the smallest kept logit was one of the ties the sampler kept: same count
    smallest = min(scaled[i] for i in kept)
    members = set(kept) if token in kept or scaled[token] == smallest else set(kept) | {token}
    largest = max(scaled[i] for i in members)
    return scaled[token] - largest - math.log(sum(math.exp(scaled[i] - largest) for i in members))


def property_rows(kind: str, rows: int, vocabulary: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of logits of one shape: flat (a random-weight model's), Zipf-like (a pretrained model's slow tail),
    peaked (a trained model's confident steps) or tied (runs of equal values, as bf16 rounding makes)."""
    if kind == "flat":
        return torch.randn(rows, vocabulary, generator=generator) * 0.3
    if kind == "zipf":
        ranks = torch.arange(1, vocabulary + 1, dtype=torch.float32)
        logits = -1.1 * ranks.log() + 0.3 * torch.randn(rows, vocabulary, generator=generator)
        return logits[:, torch.randperm(vocabulary, generator=generator)]
    if kind == "peaked":
        logits = torch.randn(rows, vocabulary, generator=generator) * 2
        logits[torch.arange(rows), torch.randint(0, vocabulary, (rows,), generator=generator)] += 12
        return logits
    return (torch.randn(rows, vocabulary, generator=generator) * 2).round()  # integers: many ties everywhere


PROPERTY_PROCESSINGS = [
    SamplerProcessing(top_k=5),
    SamplerProcessing(top_k=50),
    SamplerProcessing(top_p=0.5),
    SamplerProcessing(top_p=0.95),
    SamplerProcessing(min_p=0.1),
    SamplerProcessing(temperature=0.7, top_k=40, top_p=0.9),
    SamplerProcessing(top_k=30, top_p=0.8, min_p=0.05),
    SamplerProcessing(top_k=30, top_p=0.8, min_p=0.05, engine="vllm"),
    SamplerProcessing(temperature=1.3, top_p=0.9, min_p=0.02, engine="vllm"),
]


@pytest.mark.parametrize("kind", ["flat", "zipf", "peaked", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rule_is_the_independent_sorted_reference_on_every_shape_of_row(kind, dtype):
    """`processed_log_probs` against `reference_log_prob` (float64, one row at a time, no torch) for every processing
    of `PROPERTY_PROCESSINGS`, on 24 rows of 300 logits of each shape, in float32 and in bf16, with the sampled token
    the most likely, one inside the support and one anywhere. Tolerance: float32 logsumexps of up to 300 terms of
    values up to ~25, summed in another order (about 1e-5); a cut one token off would move a value by that token's
    share of the support, 1e-3 or more here, except where the cumulative mass lies within float32 rounding of
    1 - p (a token the two sums may order differently, which the test allows on at most one row in 50)."""
    generator = torch.Generator().manual_seed(17)
    logits = property_rows(kind, 24, 300, generator).to(dtype)
    order = logits.float().argsort(-1, descending=True)
    tokens = torch.cat([order[:8, 0], order[8:16, 3], torch.randint(0, 300, (8,), generator=generator)])
    for processing in PROPERTY_PROCESSINGS:
        got = processed_log_probs(logits, tokens, processing)
        rows = logits.float().double().tolist()
        expected = torch.tensor(
            [reference_log_prob(row, int(token), processing) for row, token in zip(rows, tokens.tolist(), strict=True)]
        )
        off = ((got.double() - expected).abs() > 1e-5 + 1e-6 * expected.abs()).sum()
        assert int(off) <= len(rows) // 50, (processing, kind, dtype, got, expected)


def trained_rows(rows: int, vocabulary: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of a trained model's shape (a steep Zipf-like fall, exponent 2.5, with noise): as on SmolLM2-135M, where a
    row's tokens of probability above top-p 0.95's floor are a few percent of the vocabulary."""
    ranks = torch.arange(1, vocabulary + 1, dtype=torch.float32)
    logits = -2.5 * ranks.log() + 0.5 * torch.randn(rows, vocabulary, generator=generator)
    return torch.stack([row[torch.randperm(vocabulary, generator=generator)] for row in logits])


def heavy_tail_rows(
    rows: int, vocabulary: int, generator: torch.Generator, top_p: float = 0.95, share_of_floor: float = 0.9
) -> torch.Tensor:
    """Rows whose tail is as heavy as top-p's floor allows: 48 tokens share most of the mass, and every other token has
    `share_of_floor` of the floor's probability (1 - p) / (2V), so the tail holds almost (1 - p) / 2, enough to move
    the cut when it is left out of the sum."""
    tail = torch.full((rows, vocabulary - 48), share_of_floor * (1 - top_p) / (2 * vocabulary))
    head = torch.rand(rows, 48, generator=generator) + 0.1
    head = head / head.sum(-1, keepdim=True) * (1 - tail.sum(-1, keepdim=True))
    probs = torch.cat([head, tail], dim=-1)
    return torch.stack([row[torch.randperm(vocabulary, generator=generator)] for row in probs]).log()


def tail_above_the_floor_rows(rows: int, vocabulary: int, generator: torch.Generator) -> torch.Tensor:
    """A tail just above top-p 0.95's floor (three times it), holding 1.5 (1 - p): top-p keeps some of it, so no floor
    may leave it out (the rule sorts these rows whole)."""
    return heavy_tail_rows(rows, vocabulary, generator, share_of_floor=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [trained_rows, heavy_tail_rows, tail_above_the_floor_rows])
def test_the_rule_sorts_only_above_the_floors_and_is_still_the_reference(shape, dtype):
    """On rows of 4,096 logits shaped like a trained model's, or with a tail as heavy as top-p's floor allows, top-p
    and min-p sort only the logits above their floors (fewer than a tenth of each row here), and the log-probs are
    `reference_log_prob`'s, as in the test above (same tolerance, no row off): what lies below the floors enters
    top-p's sum as one term, and the cut still falls where the engines' whole-row sum puts it. A tail above the floor
    is kept in part, and the log-probs are still the reference's."""
    generator = torch.Generator().manual_seed(5)
    logits = shape(24, 4096, generator).to(dtype)
    order = logits.float().argsort(-1, descending=True)
    tokens = torch.cat([order[:8, 0], order[8:16, 2], torch.randint(0, 4096, (8,), generator=generator)])
    processings = [SamplerProcessing(top_p=0.95), SamplerProcessing(top_p=0.95, min_p=0.01, engine="vllm")]
    if shape is trained_rows:  # a heavy tail rises above the floors at another temperature or p: sorted whole
        processings += [
            SamplerProcessing(top_p=0.5),
            SamplerProcessing(min_p=0.01),
            SamplerProcessing(temperature=0.8, top_p=0.9, min_p=0.02),
            SamplerProcessing(temperature=1.3, top_p=0.9, min_p=0.02, engine="vllm"),
        ]
    rows = logits.float().double().tolist()
    for processing in processings:
        groups = descending_groups(scaled_logits(logits, processing.temperature), processing)
        widest = max(group.descending.size(-1) for group in groups)
        assert (widest < 4096 // 10) == (shape is not tail_above_the_floor_rows), processing
        got = processed_log_probs(logits, tokens, processing)
        expected = torch.tensor(
            [reference_log_prob(row, int(token), processing) for row, token in zip(rows, tokens.tolist(), strict=True)],
            dtype=torch.float64,
        )
        assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-5), (processing, got, expected)


def test_one_flat_row_does_not_make_a_block_sort_whole():
    """A block of rows shaped like a trained model's with one flat row among them (as a real batch has: one
    high-entropy step among confident ones): only the flat row is sorted whole, the others only above their floors
    (grouped by width, each group as wide as its widest row), and every log-prob is the reference's (tolerance as
    above). Deciding the width for the block at once sorted all 24 rows whole, at 4x the cost on SmolLM2's rows."""
    generator = torch.Generator().manual_seed(11)
    logits = trained_rows(24, 4096, generator)
    logits[7] = torch.randn(4096, generator=generator) * 0.3  # flat: most of it above top-p's floor
    tokens = logits.argsort(-1, descending=True)[:, 1]
    processing = SamplerProcessing(top_p=0.95)
    groups = descending_groups(scaled_logits(logits, 1.0), processing)
    assert sorted(torch.cat([group.rows for group in groups]).tolist()) == list(range(24))
    whole = [group for group in groups if group.descending.size(-1) == 4096]
    assert len(whole) == 1 and whole[0].rows.tolist() == [7] and whole[0].tail is None
    assert max(group.descending.size(-1) for group in groups if group is not whole[0]) < 4096 // 10
    expected = torch.tensor(
        [
            reference_log_prob(row, int(token), processing)
            for row, token in zip(logits.double().tolist(), tokens.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(processed_log_probs(logits, tokens, processing).double(), expected, rtol=1e-6, atol=1e-5)


def test_only_the_sequences_whose_weight_reads_the_ratio_are_scored(
    truncated_samples, tiny_model_path, tmp_path, monkeypatch
):
    """Canonical TOPR pins the positives' weight at 1 ([1, 1]): on stored top-k rows (off-policy, so pi is scored on
    mu's support), the trainer projects only the negatives' tokens, and every gradient is bitwise that of the same
    step forced to score every sequence. The positives' pi/mu, not scored, is not reported (NaN); the negatives'
    is 1 at learning rate 0. Under TIS ([0, 1] on both branches) every sequence is scored."""
    import topr_trl.trainer as trainer_module

    rows_scored = []
    scoring = trainer_module.completion_processed_log_probs

    def counted(owner, hidden, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        rows_scored.append(int(attention_mask[:, -logits_to_keep:].any(-1).sum()))
        return scoring(owner, hidden, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "completion_processed_log_probs", counted)
    data = truncated_samples["top_k"]

    def one_step(name, **overrides):
        torch.manual_seed(0)
        args = TOPRConfig(
            **small_config_kwargs(
                tmp_path / name, max_steps=1, per_device_train_batch_size=16, learning_rate=0.0, **overrides
            )
        )
        trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args, train_dataset=data)
        batch = next(iter(trainer.get_train_dataloader()))
        inputs = trainer._prepare_inputs(batch)
        rows_scored.clear()
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # what the training loop sets for each step
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
        signal = inputs["topr_signal" if trainer.args.topr_signal == "reward" else "advantages"].reshape(-1)
        return loss.detach(), grads, list(rows_scored), signal, trainer

    loss, grads, scored, signal, trainer = one_step("topr")
    negatives = int((signal < 0).sum())
    assert 0 < negatives < signal.numel()
    assert scored == [negatives]
    with monkeypatch.context() as forced:
        forced.setattr(
            trainer_module, "reads_the_ratio", lambda signal, spec: torch.ones(signal.numel(), dtype=torch.bool)
        )
        all_loss, all_grads, all_scored, _, _ = one_step("all")
    assert all_scored == [signal.numel()]
    # the gradient is bitwise the same; the loss's value is not: a positive's -s * log pi reads log pi over the whole
    # vocabulary instead of on mu's support, a constant per token that moves no gradient
    assert all(torch.equal(a, b) for a, b in zip(grads, all_grads, strict=True))
    assert not torch.equal(loss, all_loss)
    metrics = trainer._metrics["train"]
    assert not metrics["topr/ratio_positive/mean"]  # no positive's ratio read: nothing logged (not a NaN)
    assert metrics["topr/ratio_negative/mean"][-1] == pytest.approx(1.0, abs=1e-4)
    _, _, tis_scored, _, _ = one_step("tis", loss_type="tis")
    assert tis_scored == [signal.numel()]
