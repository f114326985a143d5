"""Which rank this process is, from the variables that launchers set.

torchrun and the ``deepspeed`` launcher set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; Open MPI's
``mpirun`` sets ``OMPI_COMM_WORLD_*``; MPICH and Intel MPI set ``PMI_*``; Slurm's ``srun`` sets
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``. The first family present wins, in that
order, so a torchrun started inside a Slurm step reports torchrun's ranks.

Note: [the rank when it is known] Launchers set those variables before the program starts, but
a program may learn its rank later: workers of ``torch.multiprocessing.spawn`` set ``RANK``
themselves, or pass ``rank=`` to ``init_process_group``, after ``import torch``, which is when
``OFFLOADD=1`` activates. So the rank is taken where it is used, not at activation
(:func:`rank_now`): the default process group's ``get_rank()`` where one is initialized, else
the variables as they are then. Environment activation takes it at the first training forward,
which names the per-rank offload directories (and the log line), and looks again at exit for the
report and the summary line: a process group initialized then wins, else the first forward's
rank stands (a group destroyed before exit has told its rank already). ``rank_info`` at
activation only validates the variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RankInfo", "group_rank", "rank_info", "rank_now"]

_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


@dataclass(kw_only=True, frozen=True, slots=True)
class RankInfo:
    rank: int = 0
    """Global rank (0 when no launcher variable is set)."""
    world_size: int = 1
    """Number of ranks in the job."""
    local_rank: int = 0
    """Rank on this node."""
    source: str = ""
    """The variable the rank was read from (empty: none was set)."""

    @property
    def multi(self) -> bool:
        """True when the job has more than one rank."""
        return self.world_size > 1

    def label(self) -> str:
        """``"rank 1/4"`` in a multi-rank job, else ``""``."""
        return f"rank {self.rank}/{self.world_size}" if self.multi else ""


def _int(env: Mapping[str, str], var: str, default: int) -> int:
    value = env.get(var)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {value!r}") from None


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """The rank of this process; a malformed launcher variable raises naming it."""
    env = os.environ if environ is None else environ
    for rank_var, size_var, local_var in _FAMILIES:
        if rank_var in env:
            rank = _int(env, rank_var, 0)
            size = _int(env, size_var, rank + 1)
            if not 0 <= rank < max(size, 1):
                raise ValueError(f"{rank_var}={rank} is outside {size_var}={size}")
            return RankInfo(
                rank=rank,
                world_size=max(size, 1),
                local_rank=_int(env, local_var, rank),
                source=rank_var,
            )
    return RankInfo()


def group_rank(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """The rank and size of torch.distributed's default process group where one is initialized,
    else None (see [the rank when it is known]). The local rank is the launcher variables' where
    they name the same rank, else the rank itself (one node)."""
    import torch.distributed as dist  # torch is imported already where ranks are asked for

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, size = dist.get_rank(), dist.get_world_size()
    env = os.environ if environ is None else environ
    try:
        launcher = rank_info(env)
    except ValueError:  # variables the process group does not need: not ours to refuse
        launcher = RankInfo()
    same = bool(launcher.source) and (launcher.rank, launcher.world_size) == (rank, size)
    local = launcher.local_rank if same else rank
    return RankInfo(rank=rank, world_size=size, local_rank=local, source="torch.distributed")


def rank_now(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's rank as known now: its process group's, else the launcher variables' (see
    [the rank when it is known])."""
    return group_rank(environ) or rank_info(environ)
