"""Plain ints where a staged sampler's :class:`~s5loader._staging.reader.StagedIndex` was due:
found, counted and said.

An :class:`~s5loader.S5Sampler` yields ``StagedIndex`` objects: ints that also name the pass
folder their sample was staged in. A sampler or wrapper between it and the DataLoader that
turns them into plain ints (``int(i)``, ``i + 0``, a NumPy array of indices) loses the folder:
the dataset then reads the sample directly with a GET, and the files staged for it are never
read nor released, so they hold their part of the budget until staging stalls. Nothing else
would tell.

So the dataset of a staged sampler knows that sampler's staging directory (:meth:`watch`),
and for a plain int looks whether a pass folder in it holds that sample's unit staged. If one
does, the read is counted in the pass folder (``PASS/.plain``, a byte per read, which the
sampler's :attr:`~s5loader._engine.stats.Stats.plain_indices` reports) and the first one in
each process logs a warning. A plain int of a sample no pass holds (another sampler over the
same dataset, an evaluation loader between epochs) costs one directory listing and says
nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("s5loader.dataset")

PLAIN = ".plain"  # in a pass folder: a byte per plain-int read of a sample it held staged


class PlainIndices:
    """The staging directories of the staged samplers over one dataset, and whether this
    process warned about a plain int yet."""

    def __init__(self) -> None:
        self.roots: list[str] = []
        self.warned = False

    def watch(self, root: str) -> None:
        """Look into ``root`` (a sampler's staging directory) for plain ints from now on."""
        if root not in self.roots:
            self.roots.append(root)

    def check(self, index: int, unit: int) -> None:
        """Sample ``index`` (staged as ``unit``) reached the dataset as a plain int: count it
        and warn once where a pass of a watched sampler holds it staged."""
        folder = self._holding(unit)
        if folder is None:
            return
        with contextlib.suppress(OSError):  # the pass ended meanwhile
            fd = os.open(os.path.join(folder, PLAIN), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
        if not self.warned:
            self.warned = True
            log.warning(
                "sample %d reached S5Dataset as a plain int while it is staged in %s: a "
                "sampler or wrapper between S5Sampler and the DataLoader converted its StagedIndex "
                "(int(i)). The sample is fetched again with a GET and its staged files are not "
                "released, so staging stalls once they fill the budget: pass the sampler's indices "
                "through unchanged (further cases are counted in the sampler's stats.plain_indices, "
                "not logged)",
                index,
                folder,
            )

    def _holding(self, unit: int) -> str | None:
        """The pass folder of a watched sampler that holds ``unit`` staged, if any."""
        for root in self.roots:
            try:
                names = os.listdir(root)
            except OSError:  # not made yet, or removed: no pass runs there
                continue
            for name in names:
                folder = os.path.join(root, name)
                if os.path.isdir(os.path.join(folder, str(unit))):
                    return folder
        return None


def plain_reads(folder: str) -> int:
    """How many plain-int reads of its samples the pass ``folder`` counted."""
    try:
        return os.stat(os.path.join(folder, PLAIN)).st_size
    except OSError:
        return 0
