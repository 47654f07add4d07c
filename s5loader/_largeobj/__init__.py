"""Large objects through a small disk (``s5loader fetch``, checkpoints): :mod:`.transfer` (one
s5cmd transfer of a big object, multipart clean-up), :mod:`.sources` (what ``fetch`` reads and
where each object lands), :mod:`.volumes` (its work directory and the volumes of a split
archive), :mod:`.archive` (extracting a tar stream safely) and :mod:`.verify` (checksums:
``.md5`` files and ETags)."""
