"""Where the sample index comes from, read in this order: :mod:`.sample` (the sample types, a
leaf), :mod:`.listing` (listing a prefix, HEADs of objects), :mod:`.manifest` (JSON Lines
manifests), :mod:`.builder` (grouping objects into samples as they stream in) with
:mod:`.sorting` (its order check and sort), :mod:`.compact` (the compact index in flat arrays),
:mod:`.saved` (its file format), :mod:`.sources` (the index behind each ``S5Dataset``
constructor), :mod:`.share` (one process of a job lists, the others receive), :mod:`.labels`
(ImageFolder labels, grouping warnings) and :mod:`.blocks` (runs of samples one wildcard
request fetches)."""

# The saved form registers how an index pickles; loaded with the package, whichever module asks.
from . import saved as _saved  # noqa: E402,F401
