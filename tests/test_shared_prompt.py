"""The shared-prompt forward (`topr_trl.training.shared_prompt`, `TOPRConfig.topr_shared_prompt_forward`): each
distinct prompt computed once for the completions that share it gives the log-probs, entropies and gradients of
GRPOTrainer's padded forward, on each family's attention (tied and untied output layers, sliding windows, GPTNeoX's
partial rotary), under LoRA, in the trainer with every loss of the registry and with pi scored on mu's support; where
it cannot (gradient checkpointing), the padded forward runs and says so once."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from topr_trl import TOPRConfig, TOPRTrainer
from topr_trl.loss import POLICY_LOSSES
from topr_trl.training.shared_prompt import chunked_shared_prompt_logps, why_the_padded_forward_runs

from .conftest import float32_tolerance, parity_reward, small_config_kwargs


# A forward and a backward through two layers, attention reduced over other key layouts (the cache's against the
# padded row's): as the packed forward of the asynchronous trainer against a plain one (tests/test_async.py).
FORWARD_ROUNDINGS = 32
BACKWARD_ROUNDINGS = 2 * FORWARD_ROUNDINGS
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "llama tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # a window of 5 keys, shorter than every row (7-token prompts, 5-token completions), on the first layer
    "qwen2 sliding window": (
        "qwen2",
        dict(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "mistral sliding window": ("mistral", dict(num_key_value_heads=2, sliding_window=4)),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5)),
}


def fused_model(family: str, seed: int = 0):
    """A small random model of `family` in float32 with TRL's fused head (at temperature 0.7, entropies on)."""
    model_type, settings = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **SMALL, **settings)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def grouped_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two prompts (6 and 4 tokens, left-padded to 7) with three completions each (5 tokens, one of them stopping
    after 3, right-padded), rows of one group apart from each other: (input_ids, attention_mask, completion length)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_length, completion_length = 7, 5
    prompts = [torch.randint(3, 97, (n,), generator=generator) for n in (6, 4)]
    rows, masks = [], []
    for index in range(6):
        prompt = prompts[index % 2]  # the groups interleaved: sharing must not rely on neighbours
        completion = torch.randint(3, 97, (completion_length,), generator=generator)
        completion_mask = torch.ones(completion_length, dtype=torch.long)
        if index == 2:
            completion[3:], completion_mask[3:] = 0, 0
        pad = prompt_length - len(prompt)
        rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, completion]))
        masks.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones_like(prompt), completion_mask]))
    return torch.stack(rows), torch.stack(masks), completion_length


def padded_logps(model, input_ids, attention_mask, logits_to_keep):
    """GRPOTrainer 1.16's forward on whole rows (`_get_per_token_logps_and_entropies`, one chunk)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return outputs.log_probs[:, -logits_to_keep:], outputs.entropy[:, -logits_to_keep:]


def values_and_gradients(model, forward) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The forward's log-probs and entropies, and the gradient of a weighted sum of both (every position, prompt
    and output layers included, reaches it)."""
    logps, entropies = forward()
    weights = torch.linspace(-1.0, 2.0, logps.numel()).view_as(logps)
    ((logps * weights).sum() + entropies.sum()).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logps.detach(), entropies.detach(), gradients


def assert_same_as_padded(model, batch_size=None) -> None:
    input_ids, attention_mask, completion_length = grouped_batch()
    real = attention_mask[:, -completion_length:].bool()
    expected = values_and_gradients(model, lambda: padded_logps(model, input_ids, attention_mask, completion_length))
    shared = values_and_gradients(
        model,
        lambda: chunked_shared_prompt_logps(
            model, input_ids, attention_mask, completion_length, batch_size, True, contextlib.nullcontext
        )[:2],
    )
    for got, wanted in zip(shared[:2], expected[:2], strict=True):
        torch.testing.assert_close(got[real], wanted[real], **float32_tolerance(wanted[real], FORWARD_ROUNDINGS))
    assert shared[2].keys() == expected[2].keys()
    for name, wanted in expected[2].items():
        torch.testing.assert_close(shared[2][name], wanted, **float32_tolerance(wanted, BACKWARD_ROUNDINGS), msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_shared_prompt_forward_equals_the_padded_forward(family):
    assert_same_as_padded(fused_model(family).train())


def test_chunks_that_split_a_group_still_equal_the_padded_forward():
    """Rows in chunks of 4 (TRL's `batch_size`): a group split across chunks has its prompt computed in each."""
    assert_same_as_padded(fused_model("llama tied").train(), batch_size=4)


def test_a_lora_adapter_gets_the_gradients_of_the_padded_forward():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(fused_model("llama untied"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, parameter in model.named_parameters():  # LoRA's B starts at 0: move it, so that A gets a gradient too
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    assert_same_as_padded(model.train())


def test_a_wrong_share_is_caught():
    """The check above fails where rows take another group's prompt: the comparison can see a mix-up."""
    model = fused_model("llama tied").train()
    input_ids, attention_mask, completion_length = grouped_batch()
    expected, _ = padded_logps(model, input_ids, attention_mask, completion_length)
    swapped = input_ids.clone()
    swapped[:, :-completion_length] = input_ids[[1, 0, 3, 2, 5, 4], :-completion_length]
    swapped_mask = attention_mask.clone()
    swapped_mask[:, :-completion_length] = attention_mask[[1, 0, 3, 2, 5, 4], :-completion_length]
    wrong, _, _ = chunked_shared_prompt_logps(
        model, swapped, swapped_mask, completion_length, None, False, contextlib.nullcontext
    )
    assert (wrong - expected).abs().max() > 1e3 * float32_tolerance(expected, FORWARD_ROUNDINGS)["atol"]


def test_what_the_shared_forward_cannot_take_is_named():
    model = fused_model("llama tied").train()
    assert why_the_padded_forward_runs(model, 7, compute_aux_loss=False, multimodal=False) is None
    assert "multimodal" in why_the_padded_forward_runs(model, 7, compute_aux_loss=False, multimodal=True)
    assert "load-balancing" in why_the_padded_forward_runs(model, 7, compute_aux_loss=True, multimodal=False)
    assert "one token" in why_the_padded_forward_runs(model, 1, compute_aux_loss=False, multimodal=False)
    model.activation_checkpointing_enable()
    assert "gradient checkpointing" in why_the_padded_forward_runs(model, 7, compute_aux_loss=False, multimodal=False)
    assert why_the_padded_forward_runs(model.eval(), 7, compute_aux_loss=False, multimodal=False) is None


def test_the_field_takes_true_or_false_only(tmp_path):
    assert TOPRConfig(**small_config_kwargs(tmp_path)).topr_shared_prompt_forward is False
    with pytest.raises(ValueError, match="`topr_shared_prompt_forward` must be True or False"):
        TOPRConfig(**small_config_kwargs(tmp_path, topr_shared_prompt_forward="yes"))


# ----------------------------------------------------------------------------------------- in the trainer
def trainer_pair(tiny_model_path, arithmetic_dataset, tmp_path, **overrides) -> tuple[TOPRTrainer, TOPRTrainer]:
    """Two trainers on the same model and data, the padded forward and the shared-prompt one, 8 completions a
    prompt (the prompts are the longer part of each row)."""
    settings = dict(per_device_train_batch_size=8, num_generations=8, **overrides)
    trainers = [
        TOPRTrainer(
            tiny_model_path,
            parity_reward,
            args=TOPRConfig(**small_config_kwargs(tmp_path / str(on), topr_shared_prompt_forward=on, **settings)),
            train_dataset=arithmetic_dataset,
        )
        for on in (False, True)
    ]
    for trainer in trainers:  # as `Trainer.train` leaves them: gradient checkpointing acts in training mode only
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    return trainers[0], trainers[1]


def loss_and_gradients(trainer, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def tokens_through_the_backbone(trainer, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """`loss_and_gradients`, and the token positions of each of the backbone's passes."""
    from topr_trl.support.scoring import fused_head_parts

    positions = []
    backbone, _ = fused_head_parts(trainer.model)
    handle = backbone.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        loss, gradients = loss_and_gradients(trainer, inputs)
    finally:
        handle.remove()
    return loss, gradients, positions


def assert_the_trainers_agree(padded, shared, shares: bool = True, distinct: bool = False) -> None:
    """The same off-policy batch (mu's log-probs moved off pi's, so that every branch of the loss reads the ratio;
    with `distinct`, each row's prompt made its own) through both trainers: the same loss and gradients, the
    shared-prompt trainer's backbone running fewer token positions where it `shares`, as many where not."""
    torch.manual_seed(0)
    inputs = padded._prepare_inputs(next(iter(padded.get_train_dataloader())))
    if distinct:  # the last prompt token of row i becomes token i + 3 of the vocabulary
        prompt_ids = inputs["prompt_ids"].clone()
        prompt_ids[:, -1] = torch.arange(3, 3 + prompt_ids.size(0))
        inputs = {**inputs, "prompt_ids": prompt_ids}
    mask = inputs["completion_mask"].float()
    inputs = {**inputs, "old_per_token_logps": -torch.rand_like(mask) * mask}
    expected_loss, expected, padded_positions = tokens_through_the_backbone(padded, inputs)
    loss, gradients, shared_positions = tokens_through_the_backbone(shared, inputs)
    if shares:
        assert sum(shared_positions) < sum(padded_positions)
    else:
        assert shared_positions == padded_positions  # the same passes over the same rows
    torch.testing.assert_close(loss, expected_loss, **float32_tolerance(expected_loss, BACKWARD_ROUNDINGS))
    assert gradients.keys() == expected.keys()
    for name, wanted in expected.items():
        torch.testing.assert_close(gradients[name], wanted, **float32_tolerance(wanted, BACKWARD_ROUNDINGS), msg=name)


@pytest.mark.parametrize("loss_type", [*POLICY_LOSSES, "dapo"])
def test_the_trainer_with_the_shared_prompt_trains_as_with_the_padded_forward(
    loss_type, tiny_model_path, arithmetic_dataset, tmp_path
):
    assert_the_trainers_agree(*trainer_pair(tiny_model_path, arithmetic_dataset, tmp_path, loss_type=loss_type))


def test_pi_on_mus_support_reads_the_tails_of_the_shared_forward(tiny_model_path, arithmetic_dataset, tmp_path):
    """Under top-k sampling the trainer scores pi on mu's support from the backbone's hidden states of the same
    forward, which runs twice per chunk when the prompt is shared: the tails' are the ones projected."""
    padded, shared = trainer_pair(tiny_model_path, arithmetic_dataset, tmp_path, top_k=5)
    assert shared._sampler_processing is not None
    assert_the_trainers_agree(padded, shared)


def test_gradient_checkpointing_runs_the_padded_forward_and_says_so_once(
    tiny_model_path, arithmetic_dataset, tmp_path, caplog
):
    import logging

    padded, shared = trainer_pair(tiny_model_path, arithmetic_dataset, tmp_path, gradient_checkpointing=True)
    for trainer in (padded, shared):  # what `Trainer.train` does with gradient_checkpointing=True
        trainer.model.activation_checkpointing_enable()
    with caplog.at_level(logging.WARNING):
        assert_the_trainers_agree(padded, shared, shares=False)
        assert_the_trainers_agree(padded, shared, shares=False)
    said = [record for record in caplog.records if "topr_shared_prompt_forward" in record.getMessage()]
    assert len(said) == 1 and "gradient checkpointing" in said[0].getMessage()


def test_rows_that_share_no_prompt_run_the_padded_forward_once(tiny_model_path, arithmetic_dataset, tmp_path):
    """Every row with a prompt of its own (one completion each): nothing to compute once, so the shared-prompt
    trainer runs GRPOTrainer's forward as it is, no second pass."""
    assert_the_trainers_agree(*trainer_pair(tiny_model_path, arithmetic_dataset, tmp_path), shares=False, distinct=True)
