"""Errors the CLI turns into one line and an exit code: 2 for bad input (``TaskgeomError`` and
most subclasses), 3 when the environment refused (``EnvironmentRefused``), 1 when training
diverged (``TrainingDiverged``)."""


class TaskgeomError(Exception):
    """Base of every user-facing error; the message names what is wrong."""


class RunDirError(TaskgeomError):
    """A run directory that is missing, unfinished, or made by another config or version."""


class CheckpointError(TaskgeomError):
    """A checkpoint that is truncated, corrupt, foreign, or written for another config."""


class AnalysisError(TaskgeomError):
    """An analysis request that cannot be met: a layer or site that does not exist, too few states."""


class RunLockedError(TaskgeomError):
    """A run directory another process is writing (its lock is held): exit code 2."""


class EnvironmentRefused(TaskgeomError):
    """The environment refused the work (disk full, permission denied, out of memory, an
    unreachable cluster): the CLI exits with code 3."""


class ResultsLockedError(EnvironmentRefused):
    """A results folder another ``taskgeom reproduce`` is writing (its lock is held): exit code 3,
    refused before anything is trained or written."""


class TrainingDiverged(TaskgeomError):
    """Training met a non-finite loss; the run is marked diverged: the CLI exits with code 1 (the
    work ran and failed)."""
