"""Errors that mean "this input cannot be used": the CLI prints them on one line and exits 2."""


class TaskgeomError(Exception):
    """Base of every user-facing error; the message names what is wrong."""


class RunDirError(TaskgeomError):
    """A run directory that is missing, unfinished, or made by another config or version."""


class CheckpointError(TaskgeomError):
    """A checkpoint that is truncated, corrupt, foreign, or written for another config."""


class AnalysisError(TaskgeomError):
    """An analysis request that cannot be met: a layer or site that does not exist, too few states."""
