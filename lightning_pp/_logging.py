"""The ``lightning_pp`` logger: what the package tells the user (the split, the layout, ``schedule="auto"``'s choice,
a rank ending after another's failure) goes through :mod:`logging` under ``lightning_pp``, never ``print``, so a user
can silence or route it (``logging.getLogger("lightning_pp").setLevel(logging.WARNING)``).

The logger's level is INFO unless the application set one. Its records propagate as any library's do; where the
application has configured no logging (the root logger has no handler), the package's own handler writes them to
stderr as ``lightning_pp: <message>``, what is below ERROR from global rank 0 only (every rank says the same there),
errors from every rank."""

from __future__ import annotations

import logging
import sys

from lightning_utilities.core.rank_zero import rank_zero_only

__all__ = ["RankZeroBelowError", "configure"]

NAME = "lightning_pp"


class RankZeroBelowError(logging.Filter):
    """Passes a record where no root handler shows it, and below ERROR only in global rank 0 (as Lightning sets
    ``rank_zero_only.rank``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:  # the application's logging shows it
            return False
        return record.levelno >= logging.ERROR or getattr(rank_zero_only, "rank", 0) == 0


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes (pytest and others replace it)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def configure() -> logging.Logger:
    """The package's logger, with its handler where the application configured none (see the module's docstring)."""
    logger = logging.getLogger(NAME)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(handler.filters[0] if handler.filters else None, RankZeroBelowError)
               for handler in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter(f"{NAME}: %(message)s"))
        handler.addFilter(RankZeroBelowError())
        logger.addHandler(handler)
    return logger
