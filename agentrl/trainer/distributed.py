"""Data parallelism for the training workers: process groups, FSDP2 sharding, token-balanced batch
shards, and full tensors for weight sync and saving.

A worker learns its place from `Ranks`. With one rank (the local backend) nothing here touches
torch.distributed and every helper is the identity. With several, every rank receives the whole
batch and takes its own share of each mini-batch, balanced by token count; losses are normalised by
the mini-batch's global token (or sequence) count, so a step gives the same update whatever the
number of ranks. FSDP2 collectives need every rank to run the same number of forward and backward
passes: ranks with fewer micro-batches run zero-weight dummy ones (`micro_batch_plans`); a
micro-batch is one decoder call whatever its layout (packing.py), so ranks whose micro-batches pack
differently still call every layer the same number of times.

This module does not start processes (trainer/launch.py does) and knows nothing of Ray.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import unquote, urlsplit

import torch
import torch.distributed as dist

from agentrl.trainer.packing import PackCost, PackedRow, packed_rows, plan_micro_batches


@dataclass(frozen=True)
class Ranks:
    """This process's rank among `world_size` data-parallel ranks of one role."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shards(self, indices: list[int], lengths: list[int]) -> list[list[int]]:
        """`indices` dealt to ranks by token count: longest first, each to the rank with the fewest
        tokens so far (ties to the lower rank). Deterministic, so every rank computes the same plan."""
        parts: list[list[int]] = [[] for _ in range(self.world_size)]
        load = [0] * self.world_size
        for i in sorted(indices, key=lambda i: (-lengths[i], i)):
            lightest = min(range(self.world_size), key=lambda r: (load[r], r))
            parts[lightest].append(i)
            load[lightest] += lengths[i]
        return [sorted(part) for part in parts]

    def micro_batch_plan(self, indices: list[int], sequences: list[list[int]], masks: list[list[int]],
                         token_budget: int, cost: PackCost | None = None) -> list[list[PackedRow]]:
        """This rank's micro-batches of `indices` (see micro_batch_plans)."""
        return self.micro_batch_plans(indices, sequences, masks, token_budget, cost)[self.rank]

    def micro_batch_plans(self, indices: list[int], sequences: list[list[int]], masks: list[list[int]],
                          token_budget: int, cost: PackCost | None = None) -> list[list[list[PackedRow]]]:
        """Every rank's micro-batches of its share of `indices`, packed (packing.py; rows alone when
        `cost` is None) and each padded with empty ones (dummies) up to the most any rank has, so
        that all ranks make the same number of passes."""
        lengths = [len(s) for s in sequences]
        plans = [plan_micro_batches(packed_rows(part, sequences, masks, cost, token_budget), token_budget)
                 for part in self.shards(indices, lengths)]
        most = max(len(plan) for plan in plans)
        return [plan + [[] for _ in range(most - len(plan))] for plan in plans]


def is_loopback(address: str) -> bool:
    """Whether `address` (a name or an IP, IPv6 maybe in brackets) is this machine's loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def rendezvous_socket(address: str, port: int = 0) -> socket.socket:
    """A listening socket for rank 0's TCP rendezvous store, at `port` (0: a free one). torch's own
    store listens on every interface: ranks that meet at a loopback address get a socket on that
    address alone. Otherwise ranks on other nodes connect at this node's address, and the socket
    listens on every interface, as torch's store would."""
    if is_loopback(address):
        host = "127.0.0.1" if address == "localhost" else address.strip("[]")
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def file_rendezvous() -> str:
    """A fresh, empty file for torch's FileStore, as a file:// URL. Whoever made it removes it once
    the ranks are gone (remove_rendezvous): torch removes it only when every rank's store is
    destroyed, which a rank killed, or one whose interpreter exits without collecting it, never does."""
    fd, path = tempfile.mkstemp(prefix="agentrl-rendezvous-")
    os.close(fd)
    return Path(path).as_uri()


def remove_rendezvous(rendezvous: str) -> None:
    """Remove a file rendezvous's file (a TCP one leaves nothing behind). Only once its ranks are
    gone: torch's store opens the file by name for each operation."""
    url = urlsplit(rendezvous)
    if url.scheme == "file":
        Path(unquote(url.path)).unlink(missing_ok=True)


def open_rendezvous(address: str) -> tuple[str, socket.socket | None]:
    """Where one role's ranks meet, chosen by rank 0 (on the node at `address`) before the others
    join: a URL for init_process_group, and the socket rank 0 already listens on for TCP.

    Ranks that meet at a loopback address all run on this machine, and meet at a file
    (file_rendezvous), so the store opens no socket at all. torch's TCPStore would not stay on the
    machine there: its client connects over IPv6 to ::ffff:127.0.0.1 and names that address with
    getnameinfo, which sends a reverse-DNS query to the system's name server where /etc/hosts has
    no line for the v4-mapped address (most machines), once per rank. Ranks on several nodes meet
    over TCP at rank 0's node address (tcp://address:port), on a port bound now and kept bound
    until rank 0's store takes it over, so nothing else can take it in between."""
    if is_loopback(address):
        return file_rendezvous(), None
    listener = rendezvous_socket(address)
    host = address.strip("[]")
    return f"tcp://{f'[{host}]' if ':' in host else host}:{listener.getsockname()[1]}", listener


def init_process_group(ranks: Ranks, rendezvous: str, device_type: str, timeout_s: float,
                       listener: socket.socket | None = None) -> None:
    """Join the role's process group at `rendezvous` (open_rendezvous): gloo on CPU, nccl on CUDA,
    with a timeout on the rendezvous and on every collective.

    At a tcp:// rendezvous rank 0 serves the store on `listener`, a socket already listening at
    address:port (rendezvous_socket), which the store takes over; without one it binds one here,
    and the other ranks connect to address:port. At a file:// rendezvous every rank opens the
    same file."""
    if not ranks.distributed or dist.is_initialized():
        if listener is not None:
            listener.close()
        return
    url = urlsplit(rendezvous)
    timeout = timedelta(seconds=timeout_s)
    if url.scheme == "file":
        store = dist.FileStore(unquote(url.path), ranks.world_size)
        store.set_timeout(timeout)
        single_node = True
    elif url.scheme == "tcp" and url.hostname and url.port:
        address = url.hostname  # an IPv6 address without its brackets, as TCPStore takes it
        single_node = is_loopback(address)
        if ranks.rank == 0:
            listener = listener or rendezvous_socket(address, url.port)
            store = dist.TCPStore(address, listener.getsockname()[1], ranks.world_size, is_master=True,
                                  timeout=timeout, master_listen_fd=listener.detach())
        else:
            store = dist.TCPStore(address, url.port, ranks.world_size, is_master=False, timeout=timeout)
    else:
        raise ValueError(f"rendezvous {rendezvous!r}: expected file:///path or tcp://host:port")
    if device_type == "cpu" and single_node:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep single-node traffic on loopback
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=ranks.rank,
                            world_size=ranks.world_size, timeout=timeout)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model: the outermost modules of the classes its
    `_no_split_modules` names (GPT-2's `transformer.h`, MPT's `blocks`; some lists also name a
    block's attention, which its block's sharding covers), else the first ModuleList named
    '...layers'."""
    kinds = {kind for module in model.modules() for kind in (getattr(module, "_no_split_modules", None) or ())}
    blocks: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in kinds and not any(name.startswith(f"{outer}.") for outer in blocks):
            blocks[name] = module
    if blocks:
        return list(blocks.values())
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("layers"):
            return list(module)
    raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None = None, offload: bool = False,
                forward_methods: tuple[str, ...] = ()) -> None:
    """FSDP2 in place: each decoder layer, then the root. `param_dtype` bf16 computes in bf16 and
    reduces gradients in fp32; `offload` keeps the shards in CPU memory between uses (CUDA);
    `forward_methods` are methods that use the root's parameters outside `forward`."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kwargs = {}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a shard; a collective for a DTensor (every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clipped_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, rank: int,
                 what: str) -> tuple[float, bool]:
    """Clip the gradients and step the optimizer: (gradient norm, whether the step was taken).

    A norm that is not finite (a logprob or loss that overflowed somewhere) skips the step with a
    warning: one such step would turn every weight into NaN, and the run would train on from there.
    Every rank sees the same full norm, so every rank skips together.

    The gradients are freed either way: kept after the last step, a model-sized block stayed
    allocated through the weight sync and the next rollout, where a colocated engine takes its
    memory back."""
    norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
    stepped = math.isfinite(norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if not stepped and rank == 0:
        print(f"agentrl: warning: the {what} gradient norm is {norm}; this optimizer step is skipped",
              file=sys.stderr)
    return norm, stepped


def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in state_dict order, detached, each tensor once: a tied one (an output
    head sharing the embedding) comes under its first name only, and the receiver's own tie
    carries it to the other. Every rank must exhaust it."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, full_tensor(tensor.detach())


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `max_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
