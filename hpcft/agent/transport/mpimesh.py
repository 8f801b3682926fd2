"""The agents' mesh over MPI (--agent-transport mpi), so bulk bytes take the MPI library's path (Cray MPICH over
Slingshot's NICs, which TCP over hsn0 does not use). It needs no fault tolerance (the agents relaunch as one step; the
heartbeats stay on TCP); MPI ranks follow srun's task order, so the slots are all-gathered once to map them."""
from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np

from hpcft import events
from hpcft.agent.transport import mpiworld
from hpcft.agent.transport.link import TransportError
from hpcft.agent.transport.mesh import MeshBase, overlay
from hpcft.agent.transport.mpilink import MpiLink
from hpcft.agent.transport.throttle import Throttle


def rank_of_slot(slots: list[int], size: int) -> dict[int, int]:
    """slot → MPI rank from every rank's slot (indexed by rank); TransportError unless they are 0..size-1 once each."""
    if len(slots) != size or sorted(slots) != list(range(size)):
        raise TransportError(f"the agents' MPI world holds slots {slots} (by rank) where slots 0..{size - 1} were "
                             "due once each: launch exactly one agent per active slot, all in one srun step")
    return {s: r for r, s in enumerate(slots)}


class MpiMesh(MeshBase):
    """This agent's MPI links to `peers` and its overlay neighbours (collective); `timeout`: for MPI to start."""

    def __init__(self, slot: int, size: int, *, host: str = "", timeout: float = 60.0, rate: float | None = None,
                 cpu: float | None = None, peers: Collection[int] = ()):
        self.slot, self.size = slot, size
        self.peers = {}
        self.aborted = False
        self.world = mpiworld.world(timeout)
        self.throttle = Throttle(rate, cpu=cpu)  # after MPI's start-up: the cap paces the agent's work, not that
        if self.world.size != size:
            raise TransportError(f"the agents' MPI world has {self.world.size} ranks for {size} slots: the agents' "
                                 "srun step must start them under MPI (srun --mpi=…, hpcft run's --agent-mpi), one "
                                 "per active slot")
        mine, every = np.array([slot], dtype=np.int64), np.empty(size, dtype=np.int64)
        gathered = self.world.call(lambda MPI, c: c.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]),
                                   "all-gather of the slots")
        gathered.wait(timeout)
        ranks = rank_of_slot(every.tolist(), size)
        self.address = f"{host or 'mpi'}:mpi-rank-{self.world.rank}"
        wanted = sorted((set(peers) | set(overlay(slot, size))) - {slot})
        bad = [j for j in wanted if not 0 <= j < size]
        if bad:
            raise TransportError(f"slot {slot} was asked to connect to slots {bad}, outside 0..{size - 1}")
        comm = self.world.comm
        self.peers = {j: MpiLink(self.world, comm, ranks[j], f"slot {j} (MPI rank {ranks[j]})", self.throttle)
                      for j in wanted}
        for j, link in self.peers.items():
            link.slot = j
        events.emit("mesh_mpi", slot=slot, rank=self.world.rank, size=size, library=self.world.version,
                    peers=len(self.peers))

    def abort(self) -> None:
        self.aborted = True
        super().abort()

    def close(self) -> None:
        """Close the links; MPI_Finalize only after a clean run, once every agent is closing too (mpiworld.release)."""
        super().close()
        if not mpiworld.release(finalize=not self.aborted):
            events.emit("mesh_mpi_closed", level=logging.WARNING, slot=self.slot, finalized=False,
                        reason="the mesh was aborted (a peer lost or failing): MPI_Finalize skipped" if self.aborted
                        else f"not every agent was closing within {mpiworld.FINALIZE_S:g} s: MPI_Finalize skipped",
                        action="the process exits without it; the next launch is a fresh MPI world")
