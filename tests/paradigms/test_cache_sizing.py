"""The auto cache's budgets per batch size: what each size's measured peak leaves, nothing before a span that covers
the pass was measured."""
from moecc.paradigms.cache_sizing import CacheSizer


def test_unseen_batch_size_gets_no_cache():
    assert CacheSizer(limit_bytes=1000).budget(512) == 0
    assert CacheSizer(limit_bytes=1000).budget(512, training=False) == 0


def test_budget_is_the_limit_less_margin_less_the_peak_without_the_cache():
    sizer = CacheSizer(limit_bytes=1000, margin=0.1)
    sizer.observe(512, peak_bytes=700, cache_bytes=300, backward=True)  # the pass itself used 400
    assert sizer.budget(512) == 900 - 400
    assert sizer.budget(300) == 900 - 400  # fewer tokens of the same size (bucket 512)
    assert sizer.budget(2048) == 0  # a larger size is not inferred from this one


def test_more_tokens_than_measured_get_no_cache_until_a_size_that_covers_them_was_measured():
    sizer = CacheSizer(limit_bytes=1000, margin=0.0)
    sizer.observe(1100, peak_bytes=300, cache_bytes=0, backward=True)  # bucket 2048
    assert sizer.budget(1100) == 700
    assert sizer.budget(2048) == 0  # up to twice the activations of the pass measured
    sizer.observe(4000, peak_bytes=800, cache_bytes=0, backward=True)  # bucket 4096 covers 2048 tokens
    assert sizer.budget(2048) == 200 and sizer.budget(1100) == 700  # the smallest covering peak
    sizer.observe(2048, peak_bytes=550, cache_bytes=0, backward=True)
    assert sizer.budget(2048) == 450 and sizer.budget(1100) == 450


def test_a_forward_alone_does_not_open_the_cache_for_training():
    """A DPO reference forward keeps few activations: its peak alone would size the cache for a training pass far
    too large. An evaluation of that size may use it."""
    sizer = CacheSizer(limit_bytes=1000, margin=0.0)
    sizer.observe(512, peak_bytes=200, cache_bytes=0, backward=False, training=False)
    assert sizer.budget(512) == 0 and sizer.budget(512, training=False) == 800
    sizer.observe(512, peak_bytes=600, cache_bytes=0, backward=True)
    sizer.observe(512, peak_bytes=300, cache_bytes=0, backward=False)  # the largest peak of a size is kept
    assert sizer.budget(512) == 400 and sizer.budget(512, training=False) == 400


def test_forwards_differentiated_later_are_trained_by_the_span_with_their_backward():
    """Two forwards of different sizes, then one backward of their summed losses (in the second span): the first
    forward's size is measured with the second span's peak, while both forwards' activations were alive."""
    sizer = CacheSizer(limit_bytes=1000, margin=0.0)
    sizer.observe(100, peak_bytes=150, cache_bytes=0, backward=False)
    assert sizer.budget(100) == 0
    sizer.observe(300, peak_bytes=700, cache_bytes=0, backward=True)
    assert sizer.budget(100) == 300 and sizer.budget(300) == 300
    sizer.observe(3000, peak_bytes=120, cache_bytes=0, backward=False, training=False)  # an evaluation: not waiting
    sizer.observe(300, peak_bytes=700, cache_bytes=0, backward=True)
    assert sizer.budget(3000) == 0 and sizer.budget(3000, training=False) == 880


def test_budget_is_never_negative():
    sizer = CacheSizer(limit_bytes=1000, margin=0.12)
    sizer.observe(8192, peak_bytes=990, cache_bytes=0, backward=True)
    assert sizer.budget(8192) == 0
