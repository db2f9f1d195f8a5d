"""Resuming restores every trained weight, whatever names the checkpoint stores them under.

transformers renames some architectures' weights when it loads them (GPTNeoX's output layer is `embed_out` on disk and
`lm_head` in memory) and renames them back when it saves, so a checkpoint holds the on-disk names. `Trainer`'s resume
(transformers 5.23, `_load_from_checkpoint`) reads the checkpoint with `load_state_dict(strict=False)`, which knows no
renaming: the renamed weights stay as they were before training, with a warning as the only sign. Both trainers'
`_load_from_checkpoint` and `_load_best_model` call `loaded_through_renaming`, which reads such a checkpoint the way
`from_pretrained` reads a model, through the renaming, and refuses in one line a checkpoint that would leave one of
the model's weights unloaded (another architecture's, a damaged one)."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME


class CheckpointNotLoadable(ValueError):
    """A checkpoint that would leave some of the model's weights as they were: training on it would silently lose
    them."""


def stored_weight_shapes(folder: str) -> dict[str, list[int]] | None:
    """The name and shape of each weight a saved model folder stores (one safetensors file or a sharded index, read
    from the files' headers); None for a folder in another format (left to `Trainer`)."""
    single, index = os.path.join(folder, SAFE_WEIGHTS_NAME), os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as file:
            files = sorted({os.path.join(folder, shard) for shard in json.load(file)["weight_map"].values()})
    else:
        return None
    shapes = {}
    for path in files:
        with safe_open(path, framework="pt") as stored:
            shapes.update({name: list(stored.get_slice(name).get_shape()) for name in stored.keys()})
    return shapes


def load_renamed_checkpoint(model: torch.nn.Module, folder: str) -> bool:
    """Loads `folder` into `model` when the folder stores weights under names the model's state dict does not have
    (transformers' renaming, or another model's weights), through `from_pretrained`'s renaming; True when it did, False
    when every stored name is the model's own (`Trainer`'s loading is right for it). Raises `CheckpointNotLoadable`
    when a weight of the model would stay unloaded or a stored one would be dropped."""
    stored = stored_weight_shapes(folder)
    if stored is None:
        return False
    own = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    misshapen = [name for name, shape in stored.items() if name in own and own[name] != shape]
    if misshapen:  # another size of the same architecture: load_state_dict would stop on the first, in PyTorch's words
        raise CheckpointNotLoadable(
            f"the checkpoint {folder} does not fit this model ({type(model).__name__}): "
            f"{misshapen[0]} is {stored[misshapen[0]]} there and {own[misshapen[0]]} here"
            + (f", and {len(misshapen) - 1} more differ" if len(misshapen) > 1 else "")
            + "; resume from a checkpoint of the same model"
        )
    if set(stored) <= set(own):
        return False
    try:
        reloaded, info = type(model).from_pretrained(
            folder, config=model.config, dtype=model.dtype, output_loading_info=True
        )
    except (RuntimeError, ValueError, OSError) as error:  # shapes that do not fit the model, an unreadable file
        raise CheckpointNotLoadable(
            f"the checkpoint {folder} does not fit this model ({type(model).__name__}): {str(error).splitlines()[0]}"
        ) from None
    lost = sorted(info["missing_keys"] | info["unexpected_keys"] | set(info["mismatched_keys"]))
    if lost:
        shown = ", ".join(map(str, lost[:3])) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
        raise CheckpointNotLoadable(
            f"the checkpoint {folder} does not hold every weight of this model "
            f"({type(model).__name__}): {shown}; resume from a checkpoint of the same model"
        )
    model.load_state_dict(reloaded.state_dict(), strict=True)
    return True


def loaded_through_renaming(trainer, folder: str | None, model: torch.nn.Module | None = None) -> bool:
    """For a trainer's `_load_from_checkpoint` and `_load_best_model`: loads `folder` into `model` (the trainer's own
    by default) through transformers' renaming of stored weight names (see the module), True when it did; False when
    `Trainer`'s own loading is right: no folder, every stored name the model's own, or DeepSpeed, FSDP and PEFT
    adapters (adapters keep PEFT's own names)."""
    model = trainer.model if model is None else model
    if folder is None or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or hasattr(model, "peft_config"):
        return False
    return load_renamed_checkpoint(model, folder)
