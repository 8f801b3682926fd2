"""The supervisor's srun steps besides the trainers': agents, standbys, staging, node checks."""
