"""Logging, one way for every service: each line names its service (and a trainer rank its rank, under torchrun), so
the interleaved output of a run's processes reads apart; `FOLDMOE_LOG_LEVEL` (default INFO) sets the level everywhere.

    log = logs.logger("checkpointer")      # module level: foldmoe.checkpointer
    logs.configure("checkpointer")         # once, first thing in the service's main()
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "FOLDMOE_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def logger(service: str) -> logging.Logger:
    """The logger of `service`'s modules: `foldmoe.<service>` (tests and users filter on that name)."""
    return logging.getLogger(f"foldmoe.{service}")


def configure(service: str) -> None:
    """Root handler and format for this process. A level `FOLDMOE_LOG_LEVEL` does not name is reported and INFO used:
    a typo in an environment variable should not stop a service."""
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    rank = os.environ.get("RANK")
    who = f"{service} rank {rank}" if rank is not None else service
    logging.basicConfig(level=level if level in LEVELS else "INFO",
                        format=f"%(asctime)s {who} %(levelname)s %(message)s")
    if level not in LEVELS:
        logger(service).warning("%s=%s is not a log level (%s); using INFO", LEVEL_ENV, os.environ[LEVEL_ENV],
                                ", ".join(LEVELS))
