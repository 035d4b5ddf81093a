"""The training loop's garbage-collector policy (freeze after the first optimizer step, unfreeze on exit)."""

import gc
import weakref

import pytest

from modelopt_lite.training import GCPolicy


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_from_the_second_step_and_unfreeze_on_close():
    policy = GCPolicy()
    counts = []
    for _ in range(4):
        policy.before_step()
        counts.append(gc.get_freeze_count())
        policy.after_optimizer_step()
    assert counts[0] == 0
    assert all(c > 0 for c in counts[1:])
    policy.close()
    assert gc.get_freeze_count() == 0
    policy.close()  # twice is harmless


def test_close_leaves_a_freeze_it_did_not_make():
    gc.freeze()
    outside = gc.get_freeze_count()
    assert outside > 1000
    policy = GCPolicy()
    policy.close()
    # an unfreeze would empty the permanent generation; frozen objects that die meanwhile (another thread's,
    # e.g. a compile worker's) only lower the count by a few, which is why this is not an equality
    assert gc.get_freeze_count() > outside * 0.99


def test_a_cycle_held_during_training_is_freed_after_close():
    policy = GCPolicy()
    model = _Node()
    ref = weakref.ref(model)
    policy.before_step()
    policy.after_optimizer_step()  # the model is frozen now
    del model
    gc.collect()
    assert ref() is not None  # frozen objects are skipped
    policy.close()
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("refreeze_every", [None, 2])
def test_refreeze_every_releases_cycles_pinned_by_the_freeze(refreeze_every):
    policy = GCPolicy(refreeze_every=refreeze_every)
    transient = _Node()  # alive when the first freeze happens, released right after
    ref = weakref.ref(transient)
    policy.before_step()
    policy.after_optimizer_step()  # step 1: freeze pins it
    del transient
    gc.collect()
    assert ref() is not None
    policy.before_step()
    policy.after_optimizer_step()  # step 2: with refreeze_every=2, unfreeze, collect, freeze
    assert (ref() is None) == (refreeze_every == 2)
    policy.close()


def test_disabled_policy_does_nothing_and_bad_option_raises():
    policy = GCPolicy(enabled=False)
    policy.before_step()
    policy.after_optimizer_step()
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="gc_refreeze_every"):
        GCPolicy(refreeze_every=0)
