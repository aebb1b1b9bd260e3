"""Where verdicts are judged: in this process (``local``) or as Ray tasks on a cluster (``ray://HOST:PORT``).

Source: issue 16.
"""

from workbench.pool.base import (
    STATES,
    Board,
    BoardEntry,
    LocalPool,
    Pool,
    PoolError,
    board_path,
    check_parallel,
    error_phase,
    open_pool,
    read_boards,
)

__all__ = ["STATES", "Board", "BoardEntry", "LocalPool", "Pool", "PoolError", "board_path", "check_parallel",
           "error_phase", "open_pool", "read_boards"]
