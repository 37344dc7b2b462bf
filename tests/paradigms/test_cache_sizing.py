"""The auto cache's budgets per batch size: what each size's measured peak leaves, nothing for an unseen size."""
from moecc.paradigms.cache_sizing import CacheSizer


def test_unseen_batch_size_gets_no_cache():
    assert CacheSizer(limit_bytes=1000).budget(512) == 0


def test_budget_is_the_limit_less_margin_less_the_peak_without_the_cache():
    sizer = CacheSizer(limit_bytes=1000, margin=0.1)
    sizer.observe(512, peak_bytes=700, cache_bytes=300)  # the pass itself used 400
    assert sizer.budget(512) == 900 - 400
    assert sizer.budget(2048) == 0  # another size is not inferred from this one


def test_largest_peak_of_a_size_is_kept():
    sizer = CacheSizer(limit_bytes=1000, margin=0.0)
    sizer.observe(512, peak_bytes=600, cache_bytes=0)  # a training pass
    sizer.observe(512, peak_bytes=300, cache_bytes=0)  # an evaluation of the same size
    assert sizer.budget(512) == 400


def test_budget_is_never_negative():
    sizer = CacheSizer(limit_bytes=1000, margin=0.12)
    sizer.observe(8192, peak_bytes=990, cache_bytes=0)
    assert sizer.budget(8192) == 0
