"""Scoring pi on mu's support inside the trainer's own forward: the backbone's last hidden states are taken with a
forward hook (TRL's fused head never holds a row's logits whole), and the tokens whose weight reads pi/mu are projected
through the output layer as TRL's head projects them (`head_projection`), a chunk at a time, and given to the rule
(`topr_trl.support.rule`). The trainer adds the difference to TRL's log-probs as a constant (`on_mus_support`): the
ratio reads pi on mu's support while the gradient stays TRL's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, cast

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import PreTrainedConfig, PreTrainedModel
from trl.trainer.utils import maybe_gather_lm_head_ctx

from .processing import SamplerProcessing
from .rule import processed_log_probs


class CapturedBackbone(NamedTuple):
    """What `captured_outputs` saw of the backbone's forward: its last hidden states in call order (detached), and
    the autocast dtype in force there (None without autocast), which is the dtype TRL's fused head projects in."""

    hidden: list[torch.Tensor]
    autocast_dtypes: list[torch.dtype | None]

    def head_dtype(self, cast_lm_head_to_fp32: bool = False) -> torch.dtype:
        """MIRROR of TRL 1.16's head dtype (`compute_dtype`, trl/kernels/chunked_logprob.py): float32 under
        `cast_lm_head_to_fp32`, else autocast's where on, else the hidden states'. Held to TRL's by a test."""
        if cast_lm_head_to_fp32:
            return torch.float32
        return self.autocast_dtypes[0] or self.hidden[0].dtype


@contextmanager
def captured_outputs(module: torch.nn.Module) -> Iterator[CapturedBackbone]:
    """The last hidden states `module` returns while the block runs (detached, in call order) and the autocast
    dtype of each call: the backbone of TRL's fused-head forward, seen without running it twice."""
    captured = CapturedBackbone([], [])

    def hook(_module, _inputs, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        captured.hidden.append(hidden.detach())
        device = hidden.device.type
        captured.autocast_dtypes.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)

    handle = module.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def fused_head_parts(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the backbone whose last hidden state TRL's fused head projects, the causal LM that owns the head) of a policy
    as the trainer holds it, wrapped (DDP, FSDP, DeepSpeed: a DeepSpeedEngine's own `config` is DeepSpeed's dict) or
    not, PEFT or not: where TRL's `add_fused_lm_head` looks them up."""
    model = extract_model_from_parallel(model)
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model.base_model, model


@contextmanager
def head_projection(owner: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[Callable]:
    """MIRROR of the logits TRL 1.16's `add_fused_lm_head` (trl/trainer/utils.py) scores before dividing by the
    temperature, as a function of (N, H) hidden states: the output embedding (and bias) cast once to `dtype` (the
    head's own by default; `CapturedBackbone.head_dtype` for TRL's), the product rounded to it as TRL's tiles are,
    then in float32 the model's logit scale and final soft-capping where its config has them (elementwise and
    increasing: a row's largest logits are its largest products). tests/test_support.py holds it to TRL's."""
    # torch types a Module's attributes as Tensor | Module: the owner is a transformers model, its config one of theirs
    config = cast(PreTrainedConfig, owner.config).get_text_config()
    names = ("logit_scale", "output_multiplier", "lm_head_multiplier")
    scale = next((getattr(config, name) for name in names if getattr(config, name, None) is not None), None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    head = cast(PreTrainedModel, owner).get_output_embeddings()  # the causal LM (`fused_head_parts`)
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2's DTensor
        weight, bias = weight.full_tensor(), (bias.full_tensor() if bias is not None else None)
    with maybe_gather_lm_head_ctx(weight, bias):
        dtype = dtype or weight.dtype
        cast_weight = weight.detach().to(dtype)
        cast_bias = bias.detach().to(dtype) if bias is not None else None

        def project(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hidden.device.type, enabled=False):
                logits = torch.nn.functional.linear(hidden.to(cast_weight.device, dtype), cast_weight, cast_bias)
            if scale is not None:
                logits = logits.float() * scale
            if softcap is not None:
                logits = torch.tanh(logits.float() / softcap) * softcap
            return logits

        yield project


CORRECTION_CHUNK_ELEMENTS = 2**25
"""Logits the scoring holds at once (tokens x vocabulary; 128 MB in float32 and the rule's sort of them): 682 tokens
at SmolLM2's 49,152-token vocabulary, 220 at Qwen2.5's 151,936."""


def completion_processed_log_probs(
    owner: torch.nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    processing: SamplerProcessing,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`processed_log_probs` of each sequence's last `logits_to_keep` tokens (0 where `attention_mask` is 0) from
    the backbone's last hidden states (B, L, H), which predict token t at position t-1."""
    hidden = hidden[:, -logits_to_keep - 1 : -1]
    tokens = input_ids[:, -logits_to_keep:]
    positions = attention_mask[:, -logits_to_keep:].bool().nonzero(as_tuple=True)
    values = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    values[positions] = chunked_processed_log_probs(owner, hidden[positions], tokens[positions], processing, dtype).to(
        values.device
    )
    return values


def chunked_processed_log_probs(
    owner: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    processing: SamplerProcessing,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`processed_log_probs` for N tokens from their (N, H) hidden states, projected in `dtype` (`head_projection`),
    `CORRECTION_CHUNK_ELEMENTS` logits at a time."""
    vocab_size = cast(PreTrainedConfig, owner.config).get_text_config().vocab_size  # a transformers model's config
    step = max(1, CORRECTION_CHUNK_ELEMENTS // vocab_size)
    with head_projection(owner, dtype) as project:
        values = [
            processed_log_probs(
                project(hidden[start : start + step]), tokens[start : start + step].to(hidden.device), processing
            )
            for start in range(0, hidden.size(0), step)
        ]
    return torch.cat(values) if values else hidden.new_zeros(0, dtype=torch.float32)


def on_mus_support(log_probs: torch.Tensor, processed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """TRL's `log_probs` (carrying the gradient) with the value of `processed` where `valid`: the ratio reads pi on
    mu's support, and the gradient stays grad log pi (TOPR's weight is a stop-gradient constant)."""
    shift = (processed.to(log_probs.dtype) - log_probs.detach()) * valid
    return log_probs + shift
