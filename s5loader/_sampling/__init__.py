"""How a sampler orders and stages an epoch, read in this order: :mod:`.order` (the seeded
permutation, the rank split, block windows, the shuffle check), :mod:`.setup` (the sampler's
options checked and its budget sized), :mod:`.resume` (saved states: checks and positions),
:mod:`.units` (what a pass stages, as the engine asks it: samples or shard visits),
:mod:`.passes` (one staging pass after another), :mod:`.run` (a staging run: area, passes,
position, composed by the sampler and by the iterable dataset's rank host), :mod:`.epochs` (a
sampler rank's order of each epoch, its staging, its mixing and its saved state),
:mod:`.iterparts` (the iterable dataset's rank order and how its workers share it, a
worker's pass and state) with :mod:`.iterchecks` (its options checked), :mod:`.rankhost`
(a rank's run in the process that hosts it) and :mod:`.feed` (the staged indices handed from
the host to the workers)."""
