"""The one error type the data pipeline raises for user-fixable problems.

It subclasses ValueError (the project's convention for user mistakes) so callers may
catch either; every message names the file or option at fault and the fix.
"""


class DataError(ValueError):
    """A missing source, a corrupt or mismatched dataset file, or an empty corpus."""


def data_error(what: str, problem: str, fix: str) -> DataError:
    """Build a DataError reading '<what>: <problem>. Fix: <fix>'."""
    return DataError(f"{what}: {problem}. Fix: {fix}")
