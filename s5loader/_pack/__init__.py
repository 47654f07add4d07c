"""``s5loader pack``'s parts: the plan (:mod:`.plan`, pure), writing a shard (:mod:`.shard`),
the state kept under the destination (:mod:`.state`), the local work folder (:mod:`.workdir`),
packing shards of objects (:mod:`.pipeline`) and of a split archive (:mod:`.archive`)."""
