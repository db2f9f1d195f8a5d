"""What running as several processes (`accelerate launch`, DeepSpeed ZeRO) asks of the code around the trainers:
models built outside ZeRO-3's construction hooks, several trainers in one process (iterations), a policy evaluated
with its gathered weights (`evaluate_policy`), the process group ended cleanly, and a command that speaks once, from
the main process (`say`)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState
from transformers.integrations import deepspeed as hf_deepspeed
from transformers.trainer_utils import get_last_checkpoint
from trl.models import unwrap_model_for_generation


@contextmanager
def outside_zero3_construction():
    """Build a model as plain tensors even when a ZeRO-3 config is active: under ZeRO-3 transformers constructs
    models inside `deepspeed.zero.Init`, whose collectives would wait forever for processes that are not building
    the same model (the built-in model, or a behaviour model that samples on the main process alone)."""
    active = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = active


def release_for_next_trainer(trainer) -> None:
    """Free what a finished trainer holds in its accelerator (DeepSpeed engine, prepared model and optimizer) and
    forget its accelerator state, so that a next trainer can be built in the same process: accelerate refuses a
    second DeepSpeed `Accelerator` while the first one's state is alive. The process group (PartialState) is kept.
    Drop your own reference to the trainer afterwards, then call `empty_caches`."""
    trainer.accelerator.free_memory()  # destroys the DeepSpeed engine, which garbage collection alone does not
    AcceleratorState._reset_state(reset_partial_state=False)


def empty_caches() -> None:
    """Collect unreachable objects (models in reference cycles) and return cached accelerator memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluate_policy(trainer, evaluate):
    """`evaluate(model, tokenizer)` on the trainer's policy with its full weights: under ZeRO-3 they are sharded,
    so they are gathered first (as GRPOTrainer does to generate). Every process must call it."""
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        return evaluate(model, trainer.processing_class)


def last_checkpoint(output_dir) -> str | None:
    """The last Trainer checkpoint in `output_dir`, or None: also when the folder does not exist yet, which happens
    on one process while another is creating it."""
    return get_last_checkpoint(str(output_dir)) if Path(output_dir).is_dir() else None


def gpu_available() -> bool:
    """Whether an accelerator TrainingArguments can train on (and run bf16 on) is present."""
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def end_process_group() -> None:
    """Destroys the process group `accelerate launch` set up, once every process has finished (a no-op in a single
    process). torch asks programs to do this before they exit: left to interpreter shutdown, a rank can abort after
    the run has finished and saved ("terminate called without an active exception", seen once under ZeRO-3 on a
    busy CPU), which fails the launch."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def say(message: str) -> None:
    """A line of the command's own, `[topr-trl] ...`, printed once: by the main process under `accelerate launch`."""
    if PartialState().is_main_process:
        print(f"[topr-trl] {message}", flush=True)  # noqa: T201 - the command's own output
