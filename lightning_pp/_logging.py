"""The ``lightning_pp`` logger: what the package tells the user (the split, the layout, ``schedule="auto"``'s choice,
a rank ending after another's failure) goes through :mod:`logging` under ``lightning_pp``, never ``print``, so a user
can silence or route it (``logging.getLogger("lightning_pp").setLevel(logging.WARNING)``).

Every module logs through :func:`get_logger`, whose records below ERROR are made on global rank 0 only (every rank
would say the same), as Lightning's ``rank_zero_info`` does; a record about one rank's own state passes
``extra=EVERY_RANK`` and is made on every rank. The package's logger is at INFO unless the application set a level.
Its records propagate as any library's do; where the application has configured no logging (the root logger has no
handler), the package's own handler writes them to stderr as ``lightning_pp: <message>``."""

from __future__ import annotations

import logging
import sys

from lightning_utilities.core.rank_zero import rank_zero_only

__all__ = ["EVERY_RANK", "configure", "get_logger"]

NAME = "lightning_pp"
EVERY_RANK = {"every_rank": True}


class _RankZeroBelowError(logging.Filter):
    """Lets a record below ERROR through on global rank 0 only (as Lightning sets ``rank_zero_only.rank``), unless it
    was logged with ``extra=EVERY_RANK``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.ERROR or getattr(record, "every_rank", False)
                or getattr(rank_zero_only, "rank", 0) == 0)


class _WhereNoneConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes a record to stderr (as it is then: pytest replaces it) where the root logger has no handler to show it."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.setStream(sys.stderr)
            super().emit(record)


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name``, with the rank filter (see the module's docstring)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankZeroBelowError) for f in logger.filters):
        logger.addFilter(_RankZeroBelowError())
    return logger


def configure() -> logging.Logger:
    """The package's logger, at INFO unless set, with its handler for applications that configured no logging."""
    logger = logging.getLogger(NAME)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(handler, _WhereNoneConfigured) for handler in logger.handlers):
        handler = _WhereNoneConfigured()
        handler.setFormatter(logging.Formatter(f"{NAME}: %(message)s"))
        logger.addHandler(handler)
    return logger
