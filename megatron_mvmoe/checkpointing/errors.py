"""The one error a checkpoint read or write raises for a user-fixable problem."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or from an incompatible model (message: one line
    naming the problem and the fix)."""
