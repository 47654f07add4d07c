"""Tar shards in the WebDataset convention: :mod:`.index` (the shards a source names and the wids
shard index), :mod:`.indexing` (building an index: ``s5loader index-shards``), :mod:`.tar` (scanning member headers, reading members by offset),
:mod:`.dataset` (the map-style dataset over shards), :mod:`.passes` (a sampler pass that
stages whole shards) and :mod:`.stream` (the first shard of a pass, read while it downloads)."""
