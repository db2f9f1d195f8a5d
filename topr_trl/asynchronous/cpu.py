"""What TRL 1.16's asynchronous trainer needs to construct and train on a machine without CUDA.

`trl.experimental.async_grpo.AsyncGRPOTrainer` assumes a CUDA device twice:

- its constructor asks CUDA for the device's peak FLOPs (for its MFU metric), which raises without CUDA;
- its packed "tree" attention (`packing.tree_attention`, registered as `tree_fa3`) runs FlashAttention-3 from the
  `kernels` package, which has no CPU build.

`CPUSupport` is a mixin for that class and its subclasses: on a CPU it constructs the trainer with the peak FLOPs
unknown (TRL's own answer for an unknown device: MFU is not logged, every other metric is) and switches the model to
`tree_attention_sdpa`, the same attention in plain PyTorch. TRL's packing, batching, collation, weight sync and loss
are untouched. On a CUDA device the mixin does nothing.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


TRL_ASYNC_TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"
TREE_ATTENTION_SDPA = "tree_sdpa"


def tree_attention_mask(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int, sliding_window: int | None = None
) -> torch.Tensor:
    """The (N, K) boolean mask of TRL's packed tree attention: packed query n of segment s sees gathered key k of the
    same segment's path when k is not after n on that path (FlashAttention's causal rule for a segment whose queries
    are the last of its keys), and, with a `sliding_window` w, fewer than w positions before it."""
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    segment_of_query = torch.repeat_interleave(torch.arange(lengths_q.numel()), lengths_q)
    segment_of_key = torch.repeat_interleave(torch.arange(lengths_k.numel()), lengths_k)
    # each query's and key's position on its segment's root-to-segment path
    query_position = (torch.arange(segment_of_query.numel()) - cu_seqlens_q[:-1].long()[segment_of_query]
                      + (lengths_k - lengths_q)[segment_of_query])
    key_position = torch.arange(num_keys) - cu_seqlens_k[:-1].long()[segment_of_key]
    same_segment = segment_of_query[:, None] == segment_of_key[None, :]
    visible = key_position[None, :] <= query_position[:, None]
    if sliding_window:
        visible &= key_position[None, :] > query_position[:, None] - sliding_window
    return same_segment & visible


def tree_attention_sdpa(
    module, query, key, value, attention_mask, *, tree_kv_index=None, tree_cu_seqlens_q=None, tree_cu_seqlens_k=None,
    tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None, sliding_window=None, softcap=None, **kwargs,
):
    """TRL's `packing.tree_attention` (same arguments, same output) computed by `torch.nn.functional.
    scaled_dot_product_attention` with an explicit mask instead of FlashAttention-3's varlen kernel: every segment's
    queries attend to the keys and values gathered along its root-to-segment path (`tree_kv_index`). Called without
    the tree arguments (generation, evaluation, a plain forward) it is transformers' own SDPA attention, so the
    trained model generates as before."""
    if tree_kv_index is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if softcap:
        raise NotImplementedError("tree_attention_sdpa: attention logit soft-capping is not implemented (the model "
                                  "sets `attn_logit_softcapping`); train it on a GPU with TRL's tree_fa3 attention.")
    device = query.device
    # (1, H, N, D) -> (H, N, D); keys and values gathered along the paths: (H_kv, K, D)
    query = query[0]
    key = key[0].index_select(1, tree_kv_index.to(device))
    value = value[0].index_select(1, tree_kv_index.to(device))
    if key.size(0) != query.size(0):  # grouped-query attention
        key = key.repeat_interleave(query.size(0) // key.size(0), dim=0)
        value = value.repeat_interleave(query.size(0) // value.size(0), dim=0)
    mask = tree_attention_mask(tree_cu_seqlens_q.cpu(), tree_cu_seqlens_k.cpu(), key.size(1), sliding_window)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(device),
                                                              scale=scaling)
    return output.transpose(0, 1).unsqueeze(0), None  # (1, N, H, D), as TRL's


def register_tree_attention_sdpa() -> None:
    AttentionInterface.register(TREE_ATTENTION_SDPA, tree_attention_sdpa)
    # the packed forward ignores the mask (its tree arguments say what each token sees); everything else needs SDPA's
    AttentionMaskInterface.register(TREE_ATTENTION_SDPA, sdpa_mask)


@contextlib.contextmanager
def _peak_flops_unknown_on_cpu():
    """PATCH of TRL 1.16.0 `AsyncGRPOTrainer.__init__`, for the duration of the construction only: its call of
    `get_peak_flops_per_device`, which asks CUDA for the device name, returns None (unknown, as TRL returns for a GPU
    it has no table entry for) when the accelerator's device is a CPU."""
    module = importlib.import_module(TRL_ASYNC_TRAINER_MODULE)
    original = module.get_peak_flops_per_device

    def peak_flops_per_device(accelerator, dtype):
        return None if accelerator.device.type == "cpu" else original(accelerator, dtype)

    module.get_peak_flops_per_device = peak_flops_per_device
    try:
        yield
    finally:
        module.get_peak_flops_per_device = original


class CPUSupport:
    """Mixin before `AsyncGRPOTrainer` (or a subclass) in the bases: constructs and trains it on a CPU."""

    def __init__(self, *args, **kwargs):
        with _peak_flops_unknown_on_cpu():
            super().__init__(*args, **kwargs)
        if self.accelerator.device.type == "cpu":
            register_tree_attention_sdpa()
            self.accelerator.unwrap_model(self.model).set_attn_implementation(TREE_ATTENTION_SDPA)


def cpu_capable(trainer_class: type) -> type:
    """`trainer_class` (TRL's `AsyncGRPOTrainer` or a subclass) with `CPUSupport` mixed in, under the same name."""
    return type(trainer_class.__name__, (CPUSupport, trainer_class), {"__module__": __name__,
                                                                      "__doc__": trainer_class.__doc__})
