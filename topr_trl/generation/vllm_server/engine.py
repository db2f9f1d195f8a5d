"""The server side of the gloo weight path, imported in a vLLM server's worker process (never by the trainer).

`topr-trl vllm-serve` starts vLLM with `--worker-extension-cls
topr_trl.generation.vllm_server.engine.WeightSyncWorkerExtension`: vLLM imports that class in each worker before it
loads the model, and importing this module registers `GlooWeightTransferEngine` with vLLM's
`WeightTransferEngineFactory`, which the worker then builds for `--weight-transfer-config '{"backend": "topr_gloo"}'`.
vLLM's dev-mode routes drive it as they drive its NCCL engine.

What the engine does beyond moving bytes, each learned on vLLM's CPU build:
- the layerwise reload (`initialize_layerwise_reload` ... `finalize_layerwise_reload`, as vLLM's NCCL engine), since
  the CPU build re-packs linear weights after loading and only the reload can put new ones in;
- a tied output layer re-packed after it (`vllm_colocate.repack_tied_modules`): the reload never re-processes an
  `lm_head` that received no tensor of its own, and the engine would compute logits through its first load;
- a stream that cannot be loaded (another model's tensors) is still received to its end, so the trainer never
  blocks on a receiver that stopped (the trainer compares the two models' configurations before its first push,
  so this is the second line of defence);
- a push that fails half-way (the trainer died, the network failed, the tensors did not fit) leaves a partly
  overwritten model mid-reload, so the server stops rather than serve it: the trainer fails in one line and a
  restarted server loads its checkpoint again.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from ..vllm_colocate import repack_tied_modules
from . import BACKEND, log_line
from .transport import open_group, received


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What the trainer sends to `/init_weight_transfer_engine`: the rendezvous it hosts as rank 0, the group size
    (the server's workers + 1), this server's first rank in it, and the timeout of every operation."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """What the trainer sends to `/update_weights`: the tensors it is about to broadcast, in order (HF names, torch
    dtype names without `torch.`, shapes), as TRL's client sends them to the NCCL engine."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info lists differ in length: {len(self.names)} names, {len(self.dtype_names)} "
                f"dtypes, {len(self.shapes)} shapes"
            )


class TransferBroken(Exception):
    """The gloo stream stopped half-way: the model is partly overwritten."""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM weight-transfer engine over a gloo group: the trainer broadcasts checkpoint-format tensors, the worker
    loads them through the layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = open_group(
            init_info.master_address, init_info.master_port, init_info.world_size, rank, init_info.timeout_s
        )
        log_line(
            f"weight path open (gloo, rank {rank} of {init_info.world_size}, trainer at "
            f"{init_info.master_address}:{init_info.master_port})"
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # noqa: PLC0415 - as vLLM's engines do

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # noqa: PLC0415 - as vLLM's engines do

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_modules(self.model)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with `torch.accelerator.synchronize()`, which raises on a machine without an accelerator;
        # gloo's broadcast has completed when it returns, so there is nothing to wait for
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weight path not initialised: the trainer calls /init_weight_transfer_engine first")
        total, taken = len(update_info.names), 0

        def checked(stream):
            nonlocal taken
            try:
                for item in stream:
                    taken += 1
                    yield item
            except RuntimeError as error:  # gloo: the peer closed, or the timeout passed
                raise TransferBroken(f"the weight transfer broke after {taken} of {total} tensors ({error})") from error

        stream = received(self.group, update_info.names, update_info.dtype_names, update_info.shapes)
        try:
            try:
                self.model.load_weights(checked(stream))
            except TransferBroken:
                raise
            except Exception as error:  # noqa: BLE001 - another model's tensors: take the rest, so the trainer finishes sending
                for _ in checked(stream):
                    pass
                stop_server(
                    f"the pushed weights do not fit the served model {self.model_config.model!r} (tensor "
                    f"{update_info.names[taken - 1]!r}: {type(error).__name__}: {error})"
                )
        except TransferBroken as broken:
            stop_server(str(broken))

    def shutdown(self) -> None:
        self.group = None


def stop_server(reason: str) -> None:
    """A push that broke half-way left some layers of the model overwritten (or on the meta device, mid-reload):
    serving it would hand out samples of no model at all. Log one line and end this worker; vLLM then shuts the
    server down (its executor stops when a worker dies), and the trainer's pending request fails."""
    log_line(f"{reason}; the model is partly overwritten, so this server stops: restart it")
    threading.Timer(0.5, os._exit, args=(1,)).start()  # let the log line and the RPC's error reply leave first
    raise RuntimeError(f"topr-trl: {reason}; the server stops")


class WeightSyncWorkerExtension:
    """Named by `--worker-extension-cls`: vLLM imports it in each worker before loading the model, which registers
    `GlooWeightTransferEngine` (this module's import) in the worker process, where vLLM builds its engine. Its method
    is reachable through `/collective_rpc` (the name prefixed: vLLM refuses an extension that shadows a worker
    attribute)."""

    def topr_served_model(self) -> dict:
        """The served model's path and the configuration fields that fix its weights' names and shapes (the text
        model's, for a multimodal one), and the weight path this worker runs: what a trainer compares with its own
        model before its first push (`client.check_serves`)."""
        model_config = self.vllm_config.model_config
        engine = getattr(self, "weight_transfer_engine", None)
        return {
            "model": model_config.model,
            "config": model_config.hf_text_config.to_dict(),
            "weight_backend": BACKEND if isinstance(engine, GlooWeightTransferEngine) else None,
        }


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
