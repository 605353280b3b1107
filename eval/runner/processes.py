"""One process or several (``accelerate launch``): logging and the split of work between processes."""
from __future__ import annotations

__all__ = ["Log", "make_state", "process_device", "process_rank", "several", "shard"]


class Log:
    """``log(message)``: printed by the main process (``all_ranks=True``: by every process), with
    a ``[rank N]`` prefix when there are several."""

    def __init__(self, state=None):
        self.state = state

    def __call__(self, message, all_ranks=False):
        if self.state is None or self.state.num_processes == 1:
            print(message, flush=True)
        elif all_ranks or self.state.is_main_process:
            print(f"[rank {self.state.process_index}] {message}", flush=True)


def make_state(device=None):
    """The ``accelerate.PartialState`` of this process (gloo on the CPU: ``device`` cpu or no CUDA)."""
    import torch
    from accelerate import PartialState

    cpu = (device or "").startswith("cpu") or not torch.cuda.is_available()
    return PartialState(cpu=cpu)


def several(state):
    """Whether more than one process runs."""
    return state is not None and state.num_processes > 1


def shard(state, items):
    """This process's contiguous share of ``items`` (accelerate's ``split_between_processes``)."""
    if not several(state):
        return list(items)
    with state.split_between_processes(list(items)) as mine:
        return list(mine)


def process_rank(state):
    return 0 if state is None else state.process_index


def process_device(cfg, state, default=None):
    """``cfg.device``, else this process's device when there are several, else ``default``."""
    return cfg.device or (str(state.device) if several(state) else default)
