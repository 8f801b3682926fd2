"""The supervisor's srun steps besides the trainers': agents, standbys, the environment's broadcast, node checks."""
