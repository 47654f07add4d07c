"""How a sampler orders and stages an epoch, read in this order: :mod:`.order` (the seeded
permutation, the rank split, block windows, the shuffle check), :mod:`.setup` (the sampler's
options checked and its budget sized), :mod:`.resume` (saved states: checks and positions),
:mod:`.units` (what a pass stages, as the engine asks it: samples or shard visits),
:mod:`.passes` (one staging pass after another), :mod:`.run` (a staging run: area, passes,
position, composed by the sampler and by each worker of the iterable dataset) and
:mod:`.iterparts` (the iterable dataset's passes, a worker's staging, its state) with
:mod:`.workerorder` (a worker's part of the epoch in order, the shuffle buffer) and
:mod:`.iterchecks` (its options checked)."""
