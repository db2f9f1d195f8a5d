"""The gloo group between a trainer (rank 0) and a vLLM server's workers (ranks 1...), and how tensors cross it.

vLLM's `stateless_init_torch_distributed_process_group` builds such a group but has no timeout argument (it keeps
torch's 30 minutes), so a push whose other side died would hang a run for half an hour; the group is built here from
torch's own pieces with the timeout the trainer asks for. Tensors cross as their raw bytes, so any dtype (bfloat16
included) travels unchanged. Only torch is imported: the trainer needs no vLLM for this.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def open_group(host: str, port: int, world_size: int, rank: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """Join the gloo group of `world_size` ranks whose rendezvous (a TCPStore) rank 0 hosts at host:port. Blocks until
    every rank has joined, at most `timeout_s`; every later operation fails after `timeout_s` too (a dead peer fails
    at once: gloo sees the connection close)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("topr_trl_weights", store), rank, world_size, timeout)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's storage as a flat uint8 view (0-d and non-contiguous tensors included: those are copied first)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def broadcast_bytes(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` (in place on receivers) from rank 0 of `group` as bytes."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([as_bytes(tensor)], options).wait()


def received(group: dist.ProcessGroupGloo, names: list[str], dtype_names: list[str], shapes: list[list[int]]):
    """On a receiving rank: yield (name, tensor) for each tensor rank 0 broadcasts, in the announced order."""
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
        broadcast_bytes(group, tensor)
        yield name, tensor
