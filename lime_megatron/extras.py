"""Optional dependencies: the extras of ``pip install 'lime-megatron[EXTRA]'``.

The base install trains and preprocesses.  Each extra's packages are imported only inside the code
that needs them, under :func:`requires_extra`, so a missing one fails there with the command that
installs it::

    with requires_extra("plots"):
        import matplotlib
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

EXTRAS = ("gpu", "logging", "plots", "data", "hf", "eval", "analysis")
"""The extras of pyproject.toml a feature may need (``test`` installs all but ``gpu``)."""


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message names the extra that brings it."""


def install_command(extra: str) -> str:
    """The command that installs ``extra``."""
    if extra not in EXTRAS:
        raise ValueError(f"no extra {extra!r}; the extras are {', '.join(EXTRAS)}")
    return f"pip install 'lime-megatron[{extra}]'"


@contextmanager
def requires_extra(extra: str) -> Iterator[None]:
    """Imports in the block come with ``extra``: a missing module raises :class:`MissingExtraError`
    naming it and the command that installs the extra."""
    command = install_command(extra)
    try:
        yield
    except MissingExtraError:
        raise
    except ModuleNotFoundError as error:
        raise MissingExtraError(
            f"{error.name} is not installed; it comes with lime-megatron's {extra} extra: {command}", name=error.name
        ) from error
