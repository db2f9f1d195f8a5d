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

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


TREE_ATTENTION_SDPA = "tree_sdpa"


def _segment_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def _segment_layout(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed token's segment and position within it, from cumulative lengths."""
    lengths = _segment_lengths(cu_seqlens)
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return segment, torch.arange(segment.numel()) - cu_seqlens[:-1].long()[segment]


def tree_attention_mask(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int, sliding_window: int | None = None
) -> torch.Tensor:
    """The (N, K) boolean mask of TRL's packed tree attention: packed query n of segment s sees gathered key k of the
    same segment's path when k is not after n on that path (FlashAttention's causal rule for a segment whose queries
    are the last of its keys), and, with a `sliding_window` w, fewer than w positions before it."""
    lengths_q, lengths_k = _segment_lengths(cu_seqlens_q), _segment_lengths(cu_seqlens_k)
    segment_of_query, position_of_query = _segment_layout(cu_seqlens_q)
    segment_of_key, key_position = _segment_layout(cu_seqlens_k)
    if key_position.numel() != num_keys:
        raise ValueError(f"the segments hold {key_position.numel()} keys, not num_keys={num_keys}")
    # each query's position on its segment's root-to-segment path: a segment's queries are the last of its keys
    query_position = position_of_query + (lengths_k - lengths_q)[segment_of_query]
    same_segment = segment_of_query[:, None] == segment_of_key[None, :]
    visible = key_position[None, :] <= query_position[:, None]
    if sliding_window:
        visible &= key_position[None, :] > query_position[:, None] - sliding_window
    return same_segment & visible


def segment_batched_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, scaling=None, sliding_window=None):
    """The packed tree attention of `tree_attention_mask` computed segment by segment: each segment's queries and
    its path's keys are laid out as one row of a padded batch (segments x heads x longest segment x head size) and
    attended in one SDPA call with a per-segment causal mask (queries the last of their keys). Same result as the
    dense (N, K) mask over the whole packed row, at the cost of the segments' own lengths: sum over segments of
    longest-query x longest-key, where the dense mask costs N x K, which grows with the square of the number of
    samples in a row. `query` (H, N, D), `key` and `value` (H, K, D), gathered along the paths; returns (H, N, D)."""
    heads, _, size = query.shape
    lengths_q, lengths_k = _segment_lengths(cu_seqlens_q), _segment_lengths(cu_seqlens_k)
    segments, longest_q, longest_k = lengths_q.numel(), int(lengths_q.max()), int(lengths_k.max())
    segment_q, position_q = _segment_layout(cu_seqlens_q)
    segment_k, position_k = _segment_layout(cu_seqlens_k)
    slot_q = (segment_q * longest_q + position_q).to(query.device)
    slot_k = (segment_k * longest_k + position_k).to(query.device)

    def padded(tensor, slots, longest):  # (H, T, D) -> (segments, H, longest, D), zeros where a segment is shorter
        rows = tensor.new_zeros(segments * longest, heads, size).index_copy(0, slots, tensor.transpose(0, 1))
        return rows.view(segments, longest, heads, size).transpose(1, 2)

    lengths_q, lengths_k = lengths_q[:, None, None], lengths_k[:, None, None]
    row, column = torch.arange(longest_q)[None, :, None], torch.arange(longest_k)[None, None, :]
    query_position = row + lengths_k - lengths_q  # a segment's queries are the last of its path's keys
    visible = (column < lengths_k) & (column <= query_position)
    if sliding_window:
        visible &= column > query_position - sliding_window
    # padding queries see their segment's keys, so that no row is all masked (a NaN in SDPA's backward); discarded
    visible = torch.where(row < lengths_q, visible, column < lengths_k)
    output = torch.nn.functional.scaled_dot_product_attention(
        padded(query, slot_q, longest_q),
        padded(key, slot_k, longest_k),
        padded(value, slot_k, longest_k),
        attn_mask=visible[:, None].to(query.device),
        scale=scaling,
    )
    return output.transpose(1, 2).reshape(segments * longest_q, heads, size).index_select(0, slot_q).transpose(0, 1)


def tree_attention_sdpa(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    tree_kv_index=None,
    tree_cu_seqlens_q=None,
    tree_cu_seqlens_k=None,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """TRL's `packing.tree_attention` (same arguments, same output) computed by `torch.nn.functional.
    scaled_dot_product_attention` instead of FlashAttention-3's varlen kernel: every segment's queries attend to the
    keys and values gathered along its root-to-segment path (`tree_kv_index`). Segments are batched with padding
    (`segment_batched_attention`) where that costs less than one dense mask over the packed row (almost always: a
    row packs many short samples), else the dense mask (`tree_attention_mask`). Called without the tree arguments
    (generation, evaluation, a plain forward) it is transformers' own SDPA attention, so the trained model
    generates as before."""
    if tree_kv_index is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window, **kwargs
        )
    if softcap:
        raise NotImplementedError(
            "tree_attention_sdpa: attention logit soft-capping is not implemented (the model "
            "sets `attn_logit_softcapping`); train it on a GPU with TRL's tree_fa3 attention."
        )
    device = query.device
    # (1, H, N, D) -> (H, N, D); keys and values gathered along the paths: (H_kv, K, D)
    query = query[0]
    key = key[0].index_select(1, tree_kv_index.to(device))
    value = value[0].index_select(1, tree_kv_index.to(device))
    if key.size(0) != query.size(0):  # grouped-query attention
        key = key.repeat_interleave(query.size(0) // key.size(0), dim=0)
        value = value.repeat_interleave(query.size(0) // value.size(0), dim=0)
    cu_seqlens_q, cu_seqlens_k = tree_cu_seqlens_q.cpu(), tree_cu_seqlens_k.cpu()
    lengths_q, lengths_k = _segment_lengths(cu_seqlens_q), _segment_lengths(cu_seqlens_k)
    if lengths_q.numel() * int(lengths_q.max()) * int(lengths_k.max()) < query.size(1) * key.size(1):
        output = segment_batched_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, scaling, sliding_window)
    else:
        mask = tree_attention_mask(cu_seqlens_q, cu_seqlens_k, key.size(1), sliding_window)
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask.to(device), scale=scaling
        )
    return output.transpose(0, 1).unsqueeze(0), None  # (1, N, H, D), as TRL's


def register_tree_attention_sdpa() -> None:
    AttentionInterface.register(TREE_ATTENTION_SDPA, tree_attention_sdpa)
    # the packed forward ignores the mask (its tree arguments say what each token sees); everything else needs SDPA's
    AttentionMaskInterface.register(TREE_ATTENTION_SDPA, sdpa_mask)


@contextlib.contextmanager
def _peak_flops_unknown_on_cpu():
    """SEAM (docs/copies.md): during TRL 1.16.0's `AsyncGRPOTrainer.__init__` only, its module's
    `get_peak_flops_per_device`, which asks CUDA for the device name, returns None (unknown, as TRL returns for a GPU
    it has no table entry for) when the accelerator's device is a CPU. TRL has no other way to say "no peak FLOPs"."""
    from .trl_async import async_trainer_module as module  # noqa: PLC0415 - TRL's experimental API, loaded here

    original = module.get_peak_flops_per_device

    def peak_flops_per_device(accelerator, dtype):
        return None if accelerator.device.type == "cpu" else original(accelerator, dtype)

    module.get_peak_flops_per_device = peak_flops_per_device
    try:
        yield
    finally:
        module.get_peak_flops_per_device = original


def refuse_without_sdpa(model) -> None:
    """On a CPU the packed forward runs through PyTorch's SDPA (`tree_attention_sdpa`): a model whose transformers
    class has no SDPA attention (Gemma2, whose attention soft-caps its logits) is refused in one line, before it
    loads, naming the ways that work. `model`: a loaded model, or a path or Hub id."""
    from transformers import AutoConfig  # noqa: PLC0415 - only on the asynchronous CPU path
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: PLC0415 - as above

    if hasattr(model, "config"):
        model_class = type(model)
    else:
        try:
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(model)))]
        except (OSError, ValueError, KeyError):  # not a model transformers knows: its own loading says why
            return
    if not getattr(model_class, "_supports_sdpa", False):
        raise ValueError(
            f"the asynchronous trainer on a CPU runs TRL's packed attention through PyTorch's SDPA, which "
            f"{model_class.__name__} does not support in transformers: train it without --asynchronous (the "
            "synchronous trainer takes any architecture), or use one with SDPA attention (Llama and SmolLM2, "
            "Qwen2, ...)"
        )


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
    return type(
        trainer_class.__name__, (CPUSupport, trainer_class), {"__module__": __name__, "__doc__": trainer_class.__doc__}
    )
