"""A task of a sandbox test: one MPI rank (started by srun --mpi=pmix); prints its host and allreduce sum."""
from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1, op=MPI.SUM)
print(f"rank={comm.Get_rank()} size={comm.Get_size()} host={MPI.Get_processor_name()} sum={total}", flush=True)
