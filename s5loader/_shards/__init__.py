"""Tar shards in the WebDataset convention: :mod:`.source` (the shards a source names),
:mod:`.index` (the wids shard index), :mod:`.indexing` (building an index: ``s5loader
index-shards``), :mod:`.tar` and :mod:`.headers` (scanning member headers, reading members by
offset), :mod:`.dataset` (the map-style dataset over shards), :mod:`.passes` (a sampler pass
that stages whole shards), :mod:`.holding` (what the shards an order keeps staged hold) and
:mod:`.stream` (the first shard of a pass, read while it downloads)."""
