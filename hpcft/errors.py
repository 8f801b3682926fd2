"""The named exceptions of hpcft, so callers can tell "nothing to restore" from "restore failed"."""


class HpcftError(Exception):
    """Base of every error hpcft raises on purpose; its message says what is wrong and what to do."""


class ConfigError(HpcftError):
    """Bad input from the user: an option, a file, an environment variable."""


class SlurmError(HpcftError):
    """A Slurm command failed or is missing."""


class SandboxError(HpcftError):
    """The local Slurm sandbox could not be started, inspected or stopped."""


class RendezvousError(HpcftError):
    """A rank could not reach the job's rendezvous (rank 0's store) in time."""


class StoreError(HpcftError):
    """The node-local snapshot store is unusable (permissions, owner, space)."""


class StoreFullError(StoreError):
    """The store root has no space (ENOSPC, EDQUOT) for a slot: the only StoreError that space can cure."""


class CheckpointError(HpcftError):
    """A snapshot could not be taken or restored."""


class NoCheckpointError(CheckpointError):
    """Nothing to restore: no version is complete on every rank."""


class IntegrityError(CheckpointError):
    """A chunk's checksum does not match: the data is treated as lost, never loaded."""


class ManifestError(IntegrityError):
    """A manifest passes its own checksum but does not describe what restore would load (wrong types, offsets,
    sizes, chunk table, slot or rank): its version is treated as lost, never loaded."""


class MissingDependencyError(HpcftError):
    """An optional dependency (mpi4py, hip-python, ...) is needed for the requested path."""
