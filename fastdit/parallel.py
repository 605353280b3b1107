"""Context parallelism for fastdit's entry points: diffusers' Ulysses across the processes of a launcher.

fastdit has no parallel runtime of its own. ``--cp N`` on ``fastdit compare`` puts the pipeline's
transformer(s) under diffusers' context parallelism (``ContextParallelConfig(ulysses_degree=N)``),
and fastdit's methods run inside diffusers' all-to-all on each rank's heads (``fastdit.intercept``).
The processes come from a launcher::

    torchrun --nproc_per_node 2 -m fastdit.cli compare --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --cp 2

``--cp-ring M`` adds ring attention (alone, or Ulysses x ring, diffusers' unified sequence
parallelism): with ``world size = d * M * N`` processes the ranks form a ``(d, M, N)`` mesh (data,
ring, ulysses): each group of ``M * N`` consecutive ranks splits one sample; the ``d`` groups are
free for other work (``fastdit eval`` shards prompts over them). Ring attention: see docs/context_parallel.md.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


@dataclass
class ParallelSetup:
    """This process's place: ``rank`` of ``world``; ``degree`` ranks (``ring * ulysses``) split each
    sample; ``group`` is the index of this rank's context-parallel group; ``config`` the diffusers config."""

    rank: int
    world: int
    degree: int
    group: int
    device: torch.device
    config: object
    ring: int = 1

    @property
    def ulysses(self):
        return self.degree // self.ring

    def describe(self):
        """The mesh in words, e.g. ``data 1 x ring 2 x ulysses 2 (4 processes)``."""
        return f"data {self.groups} x ring {self.ring} x ulysses {self.ulysses} ({self.world} processes)"

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def groups(self):
        return self.world // self.degree

    @property
    def is_group_leader(self):
        """The first rank of its group: the one that stores the group's results."""
        return self.rank % self.degree == 0


def launched_world():
    """``(rank, world, local rank)`` from the launcher's environment, or None without one."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def check_degree(degree, command="compare", ring=1):
    """Raise ValueError unless Ulysses ``degree`` x ring ``ring`` can run here (before any model is loaded)."""
    for name, value in (("--cp", degree), ("--cp-ring", ring)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (the {'Ulysses' if name == '--cp' else 'ring'} degree), "
                             f"got {value!r}")
    total = degree * ring
    flags = f"--cp {degree}" + (f" --cp-ring {ring}" if ring > 1 else "")
    world = launched_world()
    if total > 1 and world is None:
        raise ValueError(f"{flags} needs a distributed launcher, e.g. "
                         f"torchrun --nproc_per_node {total} -m fastdit.cli {command} ... {flags}")
    if world is not None and (total > world[1] or world[1] % total):
        raise ValueError(f"{flags} does not fit the launcher's {world[1]} processes: ulysses x ring = {total} must "
                         "divide the world size")


@contextlib.contextmanager
def _cpu_accelerator_count():
    """Diffusers 0.42 places rank ``r`` on device ``r % torch.accelerator.device_count()`` even on
    a CPU (gloo) mesh, where the count is 0; count the CPU as one device while the mesh is built."""
    if torch.cuda.is_available():
        yield
        return
    accelerator = getattr(torch, "accelerator", None)
    original = getattr(accelerator, "device_count", None)
    if accelerator is None or original is None:
        yield
        return
    accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        accelerator.device_count = original


def setup(degree, ring=1):
    """Initialise the process group (NCCL on CUDA, gloo on the CPU) and the (data, ring, ulysses)
    mesh of Ulysses ``degree`` x ring ``ring``; rank 0 prints the mesh."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    check_degree(degree, ring=ring)
    rank, world, local_rank = launched_world()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    total = degree * ring
    mesh = init_device_mesh(device.type, (world // total, ring, degree), mesh_dim_names=("data", "ring", "ulysses"))
    config = ContextParallelConfig(ulysses_degree=degree, ring_degree=ring, mesh=mesh["ring", "ulysses"])
    parallel = ParallelSetup(rank, world, total, rank // total, device, config, ring)
    if parallel.is_main:
        print(f"context parallel mesh: {parallel.describe()}", flush=True)
    return parallel


def check_heads(pipe, ulysses):
    """Raise ValueError unless every attention layer's heads divide over the ``ulysses`` ranks.

    Ulysses gives each rank ``heads / ulysses`` whole heads; on a model whose head count it does not
    divide (``--cp 3`` on a 2-head model) diffusers fails with a raw reshape error inside the first
    (dense) run, so this is checked when the pipeline is put under context parallelism, before any run.
    Ring attention splits the sequence, not the heads: only the Ulysses degree counts."""
    from fastdit.pipelines import find_adapter

    if ulysses <= 1:
        return
    for name in ("transformer", "transformer_2"):
        transformer = getattr(pipe, name, None)
        if transformer is None:
            continue
        transformer = getattr(transformer, "_orig_mod", transformer)
        heads = sorted({getattr(m, "heads", None) for _, m in find_adapter(transformer).attention_modules(transformer)}
                       - {None})
        bad = [h for h in heads if h % ulysses]
        if bad:
            divisors = [d for d in range(1, bad[0] + 1) if all(h % d == 0 for h in heads)]
            raise ValueError(f"--cp {ulysses}: Ulysses splits each attention layer's heads over the ranks, but "
                             f"{type(transformer).__name__}'s layers have {bad[0]} heads, which {ulysses} does not "
                             f"divide; use --cp {' or '.join(map(str, divisors))} (or --cp-ring, which splits the "
                             f"sequence)")


def enable(pipe, parallel):
    """Put the pipeline's transformer(s) under context parallelism (patching before or after both work).
    ValueError (``check_heads``) before anything changes when the Ulysses degree does not divide the heads."""
    check_heads(pipe, parallel.ulysses)
    with _cpu_accelerator_count():
        for name in ("transformer", "transformer_2"):
            transformer = getattr(pipe, name, None)
            if transformer is not None:
                transformer.enable_parallelism(config=parallel.config)


def reduce(value, op="max", parallel=None):
    """``value`` (a float) reduced (``"max"`` or ``"mean"``) over the ranks of ``parallel``'s
    context-parallel group (every rank when None); the value itself without a process group. Every
    rank of the group must call it (a None value on one rank and not on another is an error)."""
    if value is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    group = None if parallel is None else parallel.config._flattened_mesh.get_group()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(tensor, op=reduce_op, group=group)
    if op == "mean":
        tensor /= torch.distributed.get_world_size(group)
    return float(tensor.item())


def group_share(parallel, items):
    """The contiguous share of ``items`` of this rank's group (the first groups take one more when
    the count does not divide), the same for every rank of the group."""
    items = list(items)
    base, extra = divmod(len(items), parallel.groups)
    start = parallel.group * base + min(parallel.group, extra)
    return items[start:start + base + (parallel.group < extra)]


def barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
