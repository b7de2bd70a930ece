"""The ranks of a torchrun launch, for the data generator and the trainer: who this process is, and the few
collectives they need. A process that torchrun did not start is rank 0 of 1 and never touches torch.distributed.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and MASTER_ADDR/MASTER_PORT, which init_process_group reads);
across nodes its rendezvous does the same for every process (deploy/README: multi-node training).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# One rank may be alone at work for long stretches that its peers wait out at the next collective: rank 0's
# evaluation (tau decoding on held-out prompts) and checkpoints, a rank's share of the feature cache. NCCL's
# default of 10 minutes would kill a healthy run on a large target.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=60)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that evaluates, prints progress and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def share(self, items: list) -> list:
        """This rank's items: every world-th from its rank on (disjoint across ranks, together all of them)."""
        return items[self.rank::self.world]

    def device(self, device: str) -> str:
        """Each rank on its own GPU of the node: "cuda" means cuda:LOCAL_RANK under torchrun."""
        return f"cuda:{self.local_rank}" if device == "cuda" and self.distributed else device


def ranks_from_env() -> Ranks:
    """This process's place in a torchrun launch (rank 0 of 1 without one)."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def join(ranks: Ranks, device: str) -> None:
    """Join the process group (gloo on CPUs, NCCL on GPUs); nothing for a single process."""
    if ranks.distributed and not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (the tensor itself for one process), on the tensor's device; the input is left unchanged.
    NCCL reduces on the GPU only, so a host tensor travels through this rank's GPU there."""
    if not dist.is_initialized():
        return tensor
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    total = tensor.to(on, copy=True)
    dist.all_reduce(total)
    return total.to(tensor.device)


def shard(modules, device: str) -> None:
    """Shard each module's parameters across the ranks onto `device` (FSDP2's fully_shard, one unit per module): a
    module's forward gathers its whole weights, runs, and frees them again. For frozen modules: nothing here reduces
    gradients. Every rank must then run the same sequence of forwards: each is a collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
