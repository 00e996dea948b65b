# The Python-visible part of pool_inspect.pyx (the rest is cdef, reached through pool.pyx).
from typing import ClassVar, Mapping

from gpumem.stats import StatsDict

class PoolCounters(StatsDict):
    """``CachingPool.counters()``: the vocabulary of gpumem.stats; the old names still read,
    with a DeprecationWarning."""
    what: ClassVar[str]
    renamed: ClassVar[Mapping[str, str]]
