"""Running one rank's action list: the executor (``executor``), point-to-point transfers (``p2p``) and their wire
format (``wire``), stand-ins for outputs held elsewhere (``remote``), the split backward of zero-bubble schedules
(``backward``), micro-batch splitting (``microbatch``) and the CPU allocator setting (``allocator``).

May import: ``schedule``, ``parallel``, ``errors``, ``_compat``."""
