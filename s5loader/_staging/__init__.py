"""The staging area: where files are staged and the contract between the engine that fills it
and the readers that empty it.

* :mod:`.area`: choosing the staging root against the budget, one directory per loader, one
  folder per staging pass, cleanup at exit, on SIGTERM and of dead loaders' leftovers.
* :mod:`.layout`: where sample ``i``'s files are (``PASS/<i>/<field>``) and how a reader hands
  a sample back (:meth:`StagingLayout.release`), which the engine hears as an event.
* :mod:`.plainindex`: a plain int where a staged sampler's index was due, counted and reported.
"""
