"""The training forward with each prompt computed once for all the completions that share it.

GRPOTrainer's forward runs every row as its whole prompt and completion, so a prompt with G completions goes through
the model G times. Here the distinct prompts of a batch run once, without their last token; their keys and values
reach the rows that share them as transformers' cache (`past_key_values`, one copy per row by
`Cache.batch_select_indices`, which autograd differentiates); then each row runs its last prompt token and its
completion on top, through TRL's fused head, as GRPOTrainer's forward does. The positions (the padded row's index, as
GRPOTrainer's forward has them), the masks and the keys a sliding window keeps are those of the padded forward, so the
log-probs, the entropies and the gradient are the same up to float rounding; the gradient reaches the prompts'
computation through the cache.

The backbone runs twice for each chunk of rows: the prompts, then the rows' tails (whose hidden states predict the
completion tokens: `tail_hidden_states`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..support.scoring import fused_head_parts


def why_the_padded_forward_runs(model, prompt_length: int, compute_aux_loss: bool, multimodal: bool) -> str | None:
    """None where the shared-prompt forward computes what the padded one does; otherwise why the padded forward runs
    instead (said once by the trainer)."""
    if multimodal:
        return "multimodal inputs go through the padded forward"
    if compute_aux_loss:
        return "a mixture of experts' load-balancing loss is computed over whole padded rows"
    if prompt_length < 2:
        return "prompts of one token leave nothing to share"
    _, causal_lm = fused_head_parts(model)  # unwrapped (DDP, DeepSpeed, PEFT): the model transformers checkpoints
    # transformers 5 names it activation checkpointing (the older name warns); GRPOConfig's field keeps the old name
    checkpointing = getattr(causal_lm, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(causal_lm, "is_gradient_checkpointing", False)
    if checkpointing and causal_lm.training:
        return "gradient checkpointing drops the cache transformers would hand from the prompts to the completions"
    return None


def distinct_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """The distinct prompts (ids then mask, one row each) of (B, P + C) rows, and each row's index among them."""
    prompt_length = input_ids.size(1) - logits_to_keep
    return torch.unique(
        torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length]], dim=1), dim=0, return_inverse=True
    )


def shared_prompt_logps(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs (and entropies) of the last `logits_to_keep` tokens of each row, as GRPOTrainer's forward on
    (B, P + C) rows computes them (`model` with TRL's fused head), each distinct prompt (its ids and mask) computed
    once. Prompts are left-padded, so each row's last prompt token is real."""
    prompt_length = input_ids.size(1) - logits_to_keep
    prompts, rows = distinct_prompts(input_ids, attention_mask, logits_to_keep)
    # the prompts but their last token: a one-position head, since only the cache is read
    cache = model(
        input_ids=prompts[:, : prompt_length - 1],
        attention_mask=prompts[:, prompt_length : 2 * prompt_length - 1],
        use_cache=True,
        logits_to_keep=1,
    ).past_key_values
    cache.batch_select_indices(rows)
    tail = input_ids[:, prompt_length - 1 :]
    labels = tail.masked_fill(attention_mask[:, prompt_length - 1 :] == 0, -100)
    labels[:, 0] = -100  # the last prompt token predicts the first completion token, and is not scored itself
    outputs = model(
        input_ids=tail, attention_mask=attention_mask, past_key_values=cache, labels=labels, fused_lm_head=True
    )
    entropies = outputs.entropy[:, -logits_to_keep:] if compute_entropy else None
    return outputs.log_probs[:, -logits_to_keep:], entropies


def chunked_shared_prompt_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None,
    compute_entropy: bool,
    autocast: Callable,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """`shared_prompt_logps` over chunks of `batch_size` rows under `autocast`, returned as GRPOTrainer's
    `_get_per_token_logps_and_entropies` returns them (log-probs, entropies, no auxiliary loss)."""
    batch_size = batch_size or input_ids.size(0)
    chunks = []
    for start in range(0, input_ids.size(0), batch_size):
        with autocast():
            chunks.append(
                shared_prompt_logps(
                    model,
                    input_ids[start : start + batch_size],
                    attention_mask[start : start + batch_size],
                    logits_to_keep,
                    compute_entropy,
                )
            )
    logps = torch.cat([chunk[0] for chunk in chunks])
    entropies = torch.cat([chunk[1] for chunk in chunks]) if compute_entropy else None
    return logps, entropies, None


def tail_hidden_states(hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Of the backbone's outputs during a shared-prompt forward (prompts, then tails, chunk by chunk), the tails':
    position t of a tail predicts its token t + 1, as in the padded row's last `logits_to_keep + 1` positions."""
    return list(hidden[1::2])
