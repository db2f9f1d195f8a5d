"""pi on the support mu sampled from (`topr_trl.sampler_support`): the support against transformers' own warpers,
hand-computed processed log-probs, the head held to TRL's fused log-probs, and pi/mu = 1 at learning rate 0 when mu
truncated (top-k, top-p) on the offline and online transformers paths (tests/test_vllm.py: the vLLM ones)."""

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
from topr_trl.sampler_support import (
    SamplerProcessing,
    completion_processed_log_probs,
    fused_head_parts,
    head_logits,
    processed_log_probs,
    sampler_support,
)

from .conftest import float32_tolerance, logged_values, parity_reward, small_config_kwargs


WARPERS = {"top_k": lambda s: TopKLogitsWarper(s.top_k), "top_p": lambda s: TopPLogitsWarper(s.top_p),
           "min_p": lambda s: MinPLogitsWarper(s.min_p)}


def transformers_support(logits: torch.Tensor, processing: SamplerProcessing) -> torch.Tensor:
    """The tokens transformers' generation keeps: its warpers, in its order, on logits / T (an independent
    implementation of `sampler_support` for the transformers engine)."""
    scores = logits / processing.temperature
    for name in ("top_k", "top_p", "min_p"):
        if getattr(processing, name):
            scores = WARPERS[name](processing)(None, scores)
    return torch.isfinite(scores)


@pytest.mark.parametrize("processing", [
    SamplerProcessing(top_k=3), SamplerProcessing(top_p=0.9), SamplerProcessing(temperature=0.7, top_k=5, top_p=0.8),
    SamplerProcessing(min_p=0.2), SamplerProcessing(top_k=10, top_p=0.5, min_p=0.1), SamplerProcessing(top_k=1)])
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
    assert torch.allclose(support_correction(logits, tokens, warm, 1.0), exact.gather(1, tokens.unsqueeze(1))
                          .squeeze(1), atol=1e-5)


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
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    else:
        model = Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, final_logit_softcapping=3.0))
        assert model.config.final_logit_softcapping == 3.0
    add_fused_lm_head(model, temperature=0.7)
    input_ids = torch.randint(0, 97, (3, 9))
    labels = input_ids.clone()
    backbone, owner = fused_head_parts(model)
    from topr_trl.sampler_support import captured_outputs

    with torch.no_grad(), captured_outputs(backbone) as captured:
        fused = model(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs
    hidden = captured.hidden
    logits = head_logits(owner, hidden[0][:, :-1])
    ours = (logits / 0.7).log_softmax(-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ours, fused, rtol=1e-5, atol=1e-6), (ours - fused).abs().max()
    # and without truncation at the same temperature the processed log-probs are TRL's on every completion token
    processed = completion_processed_log_probs(owner, hidden[0], input_ids, torch.ones_like(input_ids), 4,
                                               SamplerProcessing(temperature=0.7))
    assert torch.allclose(processed, fused[:, -4:], rtol=1e-5, atol=1e-6)


def test_under_autocast_the_head_projects_in_trls_dtype():
    """Under bf16 autocast (what accelerate wraps a mixed-precision forward in), TRL's fused head rounds every logit
    to bf16 before its float32 log-softmax; pi's support is scored outside that forward. `CapturedBackbone.head_dtype`
    carries the forward's dtype to the projection, so the processed log-probs without truncation are TRL's fused
    log-probs up to float32 rounding (the same bf16 products; a log-softmax over 97 tokens), while the float32
    projection an earlier version made is off by the bf16 rounding of the logits (0.12 here), over 100 times more."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from topr_trl.sampler_support import captured_outputs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
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
    ours = completion_processed_log_probs(owner, captured.hidden[0], input_ids, ones, 4, SamplerProcessing(),
                                          captured.head_dtype())
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
            model, tokenizer, arithmetic_dataset.select(range(4)), parity_reward, tmp_path_factory.mktemp(name),
            num_completions=4, max_new_tokens=6, prompts_per_shard=4, prompts_per_batch=4, show_progress=False,
            **sampling)
    return datasets


def ratios_at_learning_rate_zero(trainer) -> list[float]:
    trainer.train()
    return [value for key in ("topr/ratio_positive/min", "topr/ratio_positive/max", "topr/ratio_negative/min",
                              "topr/ratio_negative/max") for value in logged_values(trainer, key)]


@pytest.mark.parametrize("truncation", ["top_k", "top_p"])
def test_replayed_truncated_samples_give_a_ratio_of_one_at_learning_rate_zero(truncation, truncated_samples,
                                                                              tiny_model_path, tmp_path):
    """The rows store how mu sampled (`behaviour_sampling`): pi is scored on that support, so pi/mu = 1 (1e-4) with
    the trainer's own settings left at TRL's defaults (top_k 0, top_p 1). Without it the ratio is the kept mass
    multiplied over the completion's tokens (checked: far below 1)."""
    data = truncated_samples[truncation]
    assert data[0]["behaviour_sampling"][truncation] == {"top_k": 3, "top_p": 0.9}[truncation]
    args = TOPRConfig(**small_config_kwargs(tmp_path, max_steps=-1, per_device_train_batch_size=8,
                                            learning_rate=0.0))
    ratios = ratios_at_learning_rate_zero(TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args,
                                                      train_dataset=data))
    assert ratios and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios), ratios
    unsaid = data.remove_columns("behaviour_sampling")  # the trainer then assumes its own (untruncated) settings
    ratios = ratios_at_learning_rate_zero(TOPRTrainer(model=tiny_model_path, reward_funcs=stored_reward, args=args,
                                                      train_dataset=unsaid))
    assert max(ratios) < 0.9, ratios


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
    args = TOPRConfig(**small_config_kwargs(tmp_path, learning_rate=0.0, top_k=3, steps_per_generation=2,
                                            max_steps=2))
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, args=args,
                          train_dataset=arithmetic_dataset)
    assert trainer._sampler_processing == SamplerProcessing(top_k=3, top_p=1.0, engine="transformers")
    ratios = ratios_at_learning_rate_zero(trainer)
    assert ratios and all(r == pytest.approx(1.0, abs=1e-4) for r in ratios), ratios


def test_on_policy_without_kl_the_support_is_not_scored_and_training_is_the_same(tiny_model_path, arithmetic_dataset,
                                                                                  tmp_path, monkeypatch):
    """On-policy (GRPO keeps no log-probs from generation time, mu is this forward's own) and without KL, pi/mu is 1
    whatever the support: the trainer skips the extra pass through the output layer, and two optimiser steps give
    bitwise the parameters of the same run forced to score the support (a constant added to log pi moves no
    gradient). With a step per generation more, mu is the policy at generation time and the support is scored."""
    from topr_trl.head_tiles import HeadTileSupport

    calls = []
    scored = HeadTileSupport.processed
    monkeypatch.setattr(HeadTileSupport, "processed", lambda *a, **k: calls.append(1) or scored(*a, **k))

    def trained(name, **overrides):
        torch.manual_seed(0)
        args = TOPRConfig(**small_config_kwargs(tmp_path / name, **{"top_k": 3, "max_steps": 2, **overrides}))
        trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, args=args,
                              train_dataset=arithmetic_dataset)
        trainer.train()
        return [parameter.detach().clone() for parameter in trainer.model.parameters()]

    skipped = trained("skipped")
    assert calls == []
    with monkeypatch.context() as forced:
        forced.setattr(TOPRTrainer, "_mu_is_this_forward", lambda self, inputs: False)
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

    import topr_trl.sampler_support as support

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
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


def test_the_trainer_adds_a_constant_to_log_pi_and_keeps_grpos_gradient(tiny_model_path, arithmetic_dataset,
                                                                        tmp_path):
    """TOPRTrainer at top_k 3: its log-probs are TRL's plus the correction, recomputed here independently from the
    model's plain logits (no fused head, no hook), and the gradient of their sum is TRL's (the correction carries
    none)."""
    args = TOPRConfig(**small_config_kwargs(tmp_path, top_k=3))
    trainer = TOPRTrainer(model=tiny_model_path, reward_funcs=parity_reward, args=args,
                          train_dataset=arithmetic_dataset)
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
    expected = (processed_log_probs(logits, tokens, processing)
                - (logits / args.temperature).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
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

    data = truncated_samples["top_k"].select_columns(["prompt", "completion_ids", "behaviour_logps",
                                                      "behaviour_sampling", "reward"])
    path = tmp_path / f"data.{suffix}"
    if suffix == "csv":
        data.map(lambda row: {key: json.dumps(row[key]) for key in ("completion_ids", "behaviour_logps",
                                                                     "behaviour_sampling")}).to_csv(str(path))
    else:
        getattr(data, "to_json" if suffix == "jsonl" else "to_parquet")(str(path))
    loaded = load_offline_source(str(path))
    assert stored_processing([loaded], SamplerProcessing()) == SamplerProcessing(top_k=3, top_p=1.0)


@pytest.mark.parametrize("processing", [
    SamplerProcessing(top_k=3), SamplerProcessing(top_k=50), SamplerProcessing(top_p=0.9), SamplerProcessing(top_p=0.3),
    SamplerProcessing(min_p=0.05), SamplerProcessing(temperature=0.7, top_k=40, top_p=0.8),
    SamplerProcessing(top_k=20, min_p=0.2), SamplerProcessing(top_p=0.95, min_p=0.01, engine="vllm")])
def test_the_support_decided_on_the_largest_logits_is_the_whole_vocabularys(processing):
    """`processed_log_probs` decides the support on the largest logits and falls back to the whole vocabulary where
    they do not decide it: against log-softmax over transformers' own support (plus the sampled token) on a
    2,000-token vocabulary wider than the candidates, with flat rows (the nucleus runs past them), peaked rows, rows
    of ties at the top, and sampled tokens inside and outside the support. float32 logsumexps of one support in two
    orders: within 2e-5 of values up to ~10."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(48, 2000, generator=generator) * torch.linspace(0.05, 8, 48).unsqueeze(1)
    logits[:4, :60] = 5.0  # 60 ties at the top
    tokens = torch.cat([logits[:24].argsort(-1, descending=True)[:, 1],  # inside most supports
                        torch.randint(0, 2000, (24,), generator=generator)])  # mostly outside
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


@pytest.mark.parametrize("processing", [
    SamplerProcessing(top_k=3), SamplerProcessing(top_p=0.9), SamplerProcessing(min_p=0.05),
    SamplerProcessing(temperature=0.7, top_k=40, top_p=0.8), SamplerProcessing(top_p=0.95, min_p=0.01, engine="vllm")])
def test_bf16_logits_give_bitwise_the_log_probs_of_their_float32_copy(processing):
    """Under mixed precision the head's logits arrive in bf16 and are read in it (no float32 copy of every row): the
    candidates' order and ties are those of the float32 copy, and every value is converted before any arithmetic, so
    the log-probs are bit for bit those of the float32 copy. bf16 makes ties common; flat rows fall through to the
    whole vocabulary."""
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(48, 2000, generator=generator) * torch.linspace(0.05, 8, 48).unsqueeze(1)).bfloat16()
    tokens = torch.randint(0, 2000, (48,), generator=generator)
    assert torch.equal(processed_log_probs(logits, tokens, processing),
                       processed_log_probs(logits.float(), tokens, processing))


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_in_bins_is_top_p_sorted(top_p, dtype):
    """Top-p's support found in value bins (`_keep_top_p_in_bins`, no sort of the vocabulary) is the sorted rule's
    (`_keep_top_p_sorted`, which transformers' warper is held to above): on 2,000-token rows from flat to peaked,
    after an earlier filter (top-k 1,500) and where it removed a random third, and on rows of 60 ties at the top.
    Where the two masks differ, the tokens are ties whose order only the sort decides (bf16 logits), so the kept
    mass is the same: the logsumexps agree to float32 rounding of one sum in two orders (2e-6 of values <= ~10)."""
    from topr_trl.sampler_support import _keep_top_k, _keep_top_p_in_bins, _keep_top_p_sorted

    generator = torch.Generator().manual_seed(11)
    scaled = (torch.randn(96, 2000, generator=generator) * torch.linspace(0.05, 8, 96).unsqueeze(1)).to(dtype).float()
    scaled[:4, :60] = 5.0
    every = torch.ones_like(scaled, dtype=torch.bool)
    for keep in (every, _keep_top_k(scaled, every, 1500), torch.rand(scaled.shape, generator=generator) > 0.33):
        kept, undecided = _keep_top_p_in_bins(scaled, keep, top_p)
        expected = _keep_top_p_sorted(scaled, keep, top_p)
        assert int(undecided.sum()) <= 2  # a cumulative mass within 1e-6 of 1 - p: about one row in 5,000 here
        decided = ~undecided
        kept, expected, values = kept[decided], expected[decided], scaled[decided]
        assert not bool((kept & ~keep[decided]).any())
        assert_same_support(kept, expected, values)
        if dtype == torch.float32:  # distinct values (the tied rows first): the same tokens
            assert torch.equal(kept[decided[:4].sum():], expected[decided[:4].sum():])
        assert torch.allclose(values.masked_fill(~kept, -math.inf).logsumexp(-1),
                              values.masked_fill(~expected, -math.inf).logsumexp(-1), rtol=0, atol=2e-6)
    ties = torch.zeros(1, 60)  # 12 of 60 ties hold exactly 1 - 0.8 of the mass: rounding decides, so the sort does
    assert _keep_top_p_in_bins(ties, torch.ones_like(ties, dtype=torch.bool), 0.8)[1].tolist() == [True]


def test_a_cut_at_the_last_token_under_the_crossing_bin_is_left_to_the_sort():
    """Four small tokens (each in its own bin) far under one large token, with p such that the four hold 1 - p of
    the row's mass within rounding: the fourth's cumulative mass is 1 - p, which the sort's order decides. It lies in
    a bin under the crossing one (the large token's), where no token comes near 1 - p: the row is undecided, not cut
    where the bins' sum puts it, by the whole row's bins and by the band's (all five tokens its members). With 1 - p
    halfway through the third token's mass the row is decided: the last three kept."""
    from topr_trl.sampler_support import _keep_top_p_in_bins, nucleus_from_band

    row = torch.tensor([[0.0, 0.01, 0.02, 0.03, 6.0]])
    every = torch.ones_like(row, dtype=torch.bool)
    small = (row[0, :4] - 6.0).double().exp()
    whole = 1 + float(small.sum())
    # 1 - p just above the four's mass (2^-21 of it, half of `TOP_P_ROUNDING`): the bins put the crossing in the large
    # token's bin, past float32's rounding of the sums (a few 2^-24)
    at_the_cut = 1 - float(small.sum()) * (1 + 2**-21) / whole
    inside = 1 - float(small[:2].sum() + small[2] / 2) / whole
    assert _keep_top_p_in_bins(row, every, at_the_cut)[1].tolist() == [True]
    kept, undecided = _keep_top_p_in_bins(row, every, inside)
    assert undecided.tolist() == [False] and kept.tolist() == [[False, False, True, True, True]]

    def band(top_p: float):
        return nucleus_from_band(torch.zeros(5, dtype=torch.long), row[0], torch.zeros(1), (row - 6.0).exp().sum(-1),
                                 torch.tensor([6.0]), torch.tensor([6.0]), top_p)

    assert band(at_the_cut)[1].tolist() == [True]
    normaliser, undecided = band(inside)
    assert undecided.tolist() == [False]
    torch.testing.assert_close(normaliser, row[:, 2:].logsumexp(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("where", ["in the crossing bin", "under it"])
def test_a_cut_within_rounding_that_may_move_only_negligible_tokens_is_decided_by_the_bins(where):
    """A row of one large token over many small ones, with 1 - p exactly the cumulative mass of the k-th small token
    (within `TOP_P_ROUNDING`: the order of the sum decides whether it is removed). "in the crossing bin": the small
    tokens all at 0, k = 13,107 of them, 1 - p in their bin; "under it": k small tokens at 0 and the next ones at
    0.5 (another bin), 1 - p the mass of the bin under the crossing one. Where the small tokens weigh 2^-18 of the
    row (each under `TOP_P_NEGLIGIBLE` = 2^-17 of the support, as a flat 151,936-token row's do), the row is decided
    by the whole row's bins and by the band's, and its support's logsumexp is the sort's to one small token's share
    of the support (4.0e-6 or 6.6e-6 at 0.5, the most the cut may move) plus float32's rounding of a log near 12.5
    (1e-6). Where they weigh 2^-13, the row is left to the sort, as before. The bins' masses are summed in float64:
    in float32 the 13,107 equal weights under the crossing bin summed 1.4e-4 under their mass, and the bins removed
    a token at 0.5 as well, far from 1 - p."""
    from topr_trl.sampler_support import _keep_top_p_in_bins, _keep_top_p_sorted, nucleus_from_band

    for total, decided in ((2.0**18, True), (2.0**13, False)):
        k = int(0.05 * total)
        if where == "in the crossing bin":
            small = torch.zeros(int(total * 0.15))
        else:
            small = torch.cat([torch.zeros(k), torch.full((int(total * 0.1),), 0.5)])
        rest = total - float(small.double().exp().sum())
        row = torch.cat([small, torch.tensor([math.log(rest)])]).unsqueeze(0)
        top_p = 1 - k / total  # 1 - p is the k-th small token's cumulative mass
        every = torch.ones_like(row, dtype=torch.bool)
        kept, undecided = _keep_top_p_in_bins(row, every, top_p)
        assert undecided.tolist() == [not decided]
        reference = row.amax(dim=-1)
        normaliser, band_undecided = nucleus_from_band(torch.zeros(row.size(-1), dtype=torch.long), row[0],
                                                       torch.zeros(1), (row - reference).exp().sum(-1), reference,
                                                       reference, top_p)
        assert band_undecided.tolist() == [not decided]
        if decided:
            expected = row.masked_fill(~_keep_top_p_sorted(row, every, top_p), -math.inf).logsumexp(-1)
            one_token = float(small.max().exp()) / (top_p * total)
            for got in (row.masked_fill(~kept, -math.inf).logsumexp(-1), normaliser):
                assert float((got - expected).abs()) <= one_token + 1e-6


def test_a_cut_on_the_candidates_within_rounding_of_p_goes_to_the_sort_unless_it_may_move_only_negligible_tokens(
        monkeypatch):
    """Top-p decided on a row's 1,024 largest logits (of 2,000), with p exactly the mass above a candidate (the
    order of the sum decides whether it stays). Ten tied tokens of 0.1 of the mass each and p = 0.7: the cut may
    move a token of 0.1, so the row is left to the sort (its whole vocabulary, then `_keep_top_p_sorted`), and
    the value is the sorted rule's (1e-6); decided on the candidates, the eighth tie was kept or not by their sum's
    rounding (0.13 in the log). One token of most of the mass and 1,999 of 2^-19 each, p the mass above the 101st
    of them: the cut may move one of 2^-19, so the candidates decide it, within that token's share of the support
    plus 1e-6 of the sort's value, and no row takes its whole vocabulary."""
    from topr_trl import sampler_support as support

    sorted_rows, whole_rows = [], []
    keep_sorted, whole_vocabulary = support._keep_top_p_sorted, support._whole_vocabulary_normaliser
    monkeypatch.setattr(support, "_keep_top_p_sorted",
                        lambda scaled, *a: sorted_rows.append(scaled.size(0)) or keep_sorted(scaled, *a))
    monkeypatch.setattr(support, "_whole_vocabulary_normaliser",
                        lambda logits, *a: whole_rows.append(logits.size(0)) or whole_vocabulary(logits, *a))
    ties = torch.cat([torch.zeros(10), torch.full((1990,), -30.0)])
    light = 2.0**-19 / (1 - 1999 * 2.0**-19)  # each small token's weight against the large token's 1
    many = torch.cat([torch.zeros(1), torch.full((1999,), math.log(light))])
    total_many = 1 + 1999 * light
    for row, top_p, sorted_expected, tolerance in (
            (ties, 0.7, [1], 1e-6),
            (many, (1 + 100 * light) / total_many, [], light / ((1 + 100 * light) / total_many) / total_many + 1e-6)):
        sorted_rows.clear(), whole_rows.clear()
        row = row.unsqueeze(0)
        token = torch.zeros(1, dtype=torch.long)
        processing = SamplerProcessing(top_p=float(top_p))
        got = support.processed_log_probs(row, token, processing)
        assert sorted_rows == whole_rows == sorted_expected
        expected = log_softmax_on_support(row, keep_sorted(row, torch.ones_like(row, dtype=torch.bool), top_p), token)
        assert float((got - expected).abs()) <= tolerance


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_the_nucleus_decided_on_a_band_of_each_rows_values_is_the_sorted_rules(top_p):
    """`nucleus_from_band` given, for 12 rows of 3,000 logits from flat to peaked, only the logits in a band around
    where the ascending mass passes 1 - p (in one shuffled list, rows interleaved), the mass under the band and the
    whole mass: the support's logsumexp with the sampled token is the sorted rule's (`_keep_top_p_sorted`), to the
    float32 rounding of 3,000-term sums in two orders (relative 2e-6 of masses of order 1 to 3,000: 2e-6 absolute in
    the log). A band above the crossing, one under it and a row without members are undecided."""
    from topr_trl.sampler_support import _keep_top_p_sorted, nucleus_from_band

    generator = torch.Generator().manual_seed(17)
    rows = torch.randn(15, 3000, generator=generator) * torch.linspace(0.2, 3.0, 15).unsqueeze(1)
    reference = rows.amax(dim=-1)
    weights = (rows - reference[:, None]).exp()
    keep = _keep_top_p_sorted(rows, torch.ones_like(rows, dtype=torch.bool), top_p)
    smallest_kept = rows.masked_fill(~keep, math.inf).amin(dim=-1)
    largest_removed = rows.masked_fill(keep, -math.inf).amax(dim=-1)
    under = torch.rand(15, generator=generator) * 0.3 + 0.05  # the band's edges: a share of the values around the cut
    low = largest_removed - under * (largest_removed - rows.amin(dim=-1))
    high = smallest_kept + under * (reference - smallest_kept)
    low[12], high[12] = smallest_kept[12] + 1e-3, math.inf  # above the crossing: the removed tokens under the band
    low[13], high[13] = rows[13].amin(), largest_removed[13]  # under the crossing: every member removed
    high[14] = low[14]  # no members
    inside = (rows >= low[:, None]) & (rows < high[:, None])
    row, column = inside.nonzero(as_tuple=True)
    shuffled = torch.randperm(row.numel(), generator=generator)
    below = weights.masked_fill(rows >= low[:, None], 0.0).sum(dim=-1)
    tokens = torch.stack([keep[r].nonzero()[r % 3, 0] if r % 2 else (~keep[r]).nonzero()[0, 0] for r in range(15)])
    chosen = rows.gather(-1, tokens[:, None]).squeeze(-1)
    normaliser, undecided = nucleus_from_band(row[shuffled], rows[row, column][shuffled], below, weights.sum(-1),
                                              reference, chosen, top_p)
    assert undecided.tolist() == [False] * 12 + [True] * 3
    expected = log_softmax_on_support(rows, keep, tokens)
    torch.testing.assert_close((chosen - normaliser)[:12], expected[:12], rtol=0, atol=2e-6)


def test_a_tokens_weight_far_below_its_rows_largest_is_floored_at_float32s_smallest_normal():
    """`mass_weights` is exp(x - reference) down to x - reference = -87 and e^-87 below it (a subnormal or zero
    exactly, else). On rows whose logits span hundreds (a trained model's peaked rows), top-p in bins is still the
    sorted rule, and tokens outside an earlier filter still weigh nothing: the floor moves a row's mass by under
    1e-32 of itself."""
    from topr_trl.sampler_support import EXP_FLOOR, _keep_top_p_in_bins, _keep_top_p_sorted, mass_weights

    x = torch.tensor([[0.0, -1.5, -50.0, -86.9, -87.0, -87.1, -100.0, -1000.0, -math.inf]])
    floor = math.exp(EXP_FLOOR)
    expected = torch.tensor([[1.0, math.exp(-1.5), math.exp(-50.0), math.exp(-86.9), floor, floor, floor, floor,
                              floor]])
    torch.testing.assert_close(mass_weights(x, torch.zeros(1, 1)), expected, rtol=2e-6, atol=0)  # exp near e^-87
    generator = torch.Generator().manual_seed(5)
    scaled = torch.randn(64, 2000, generator=generator) * torch.linspace(20, 120, 64).unsqueeze(1)
    every = torch.ones_like(scaled, dtype=torch.bool)
    for keep in (every, torch.rand(scaled.shape, generator=generator) > 0.33):
        for top_p in (0.5, 0.95):
            kept, undecided = _keep_top_p_in_bins(scaled, keep, top_p)
            assert not bool(undecided.any())
            assert torch.equal(kept, _keep_top_p_sorted(scaled, keep, top_p))


def test_flat_rows_past_the_candidates_are_decided_without_sorting_the_vocabulary(monkeypatch):
    """A flat 5,000-token row under top_p 0.95 passes the 1,024 candidates and takes the whole vocabulary, where top-p
    is decided in bins: no row is sorted, and the values are log-softmax over transformers' support (2e-5, as
    above). A row whose bins the float rounding leaves undecided is sorted, alone."""
    from topr_trl import sampler_support as support

    generator = torch.Generator().manual_seed(13)
    logits = torch.randn(16, 5000, generator=generator) * 0.6
    tokens = torch.randint(0, 5000, (16,), generator=generator)
    processing = SamplerProcessing(top_p=0.95)
    sorted_rows = []
    keep_sorted = support._keep_top_p_sorted
    monkeypatch.setattr(support, "_keep_top_p_sorted",
                        lambda scaled, *a: sorted_rows.append(scaled.size(0)) or keep_sorted(scaled, *a))
    keep = transformers_support(logits, processing)
    assert bool((keep.sum(-1) > support.SUPPORT_CANDIDATES).all())
    expected = log_softmax_on_support(logits, keep, tokens)
    assert torch.allclose(support.processed_log_probs(logits, tokens, processing), expected, atol=2e-5)
    assert sorted_rows == []
    in_bins = support._keep_top_p_in_bins
    monkeypatch.setattr(support, "_keep_top_p_in_bins",
                        lambda scaled, keep, p: (in_bins(scaled, keep, p)[0], torch.arange(scaled.size(0)) == 3))
    assert torch.allclose(support.processed_log_probs(logits, tokens, processing), expected, atol=2e-5)
    assert sorted_rows == [1]


def test_the_share_band_is_each_rows_own_and_open_where_a_share_is_not_reached():
    """`share_band` with per-row shares gives each row the edges it gets alone; a high share no bin reaches (a
    share of 1 and more) leaves the band open above (inf), not closed at the first bin."""
    from topr_trl.sampler_support import share_band

    rows = torch.randn(2, 500, generator=torch.Generator().manual_seed(1))
    low, high = share_band(rows, torch.tensor([[0.05], [0.3]]), torch.tensor([[0.1], [0.4]]))
    for row, (low_share, high_share) in enumerate([(0.05, 0.1), (0.3, 0.4)]):
        alone = share_band(rows[row:row + 1], low_share, high_share)
        assert low[row] == alone[0][0] and high[row] == alone[1][0]
    assert bool((low < high).all())
    _, unreached = share_band(rows, 0.1, 1.5)
    assert bool(torch.isinf(unreached).all())
