"""check_invariants reports a broken front cache as an AssertionError that says what is wrong
(the walker's findings about front caches had no message, so such a report died with an
IndexError). Level: real (the pool's C structures, skewed through the public pool.pxd by a
tiny extension compiled at test time, as tests/core/test_cython_api.py does)."""
from __future__ import annotations

import textwrap

import pytest

from gpumem._core.pool import CachingPool
from cython_build import build_extension

PYX = textwrap.dedent("""
    # cython: language_level=3
    # distutils: language = c++
    from gpumem._core.pool cimport CachingPool, gm_pool

    def skew_front_cache_bytes(CachingPool pool, long long delta):
        '''Add delta to front cache 0's cached_bytes counter: a corruption to detect.'''
        cdef gm_pool* p = pool._p
        p.shards[0].cached_bytes.store(<size_t>(p.shards[0].cached_bytes.load() + delta))
""")


@pytest.fixture(scope="module")
def skewer(tmp_path_factory):
    return build_extension(tmp_path_factory.mktemp("pool_findings"), PYX)


@pytest.mark.slow
def test_a_front_cache_counter_off_by_a_block_is_named(skewer):
    pool = CachingPool()
    pool.check_invariants()                           # a fresh pool is sound
    skewer.skew_front_cache_bytes(pool, 512)
    with pytest.raises(AssertionError) as err:
        pool.check_invariants()
    assert str(err.value) == ("pool invariants broken:\n"
                              "  front cache 0: cached_bytes 512 but a recount gives 0")
    skewer.skew_front_cache_bytes(pool, -512)         # put back: sound again
    pool.check_invariants()
