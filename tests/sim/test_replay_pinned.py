"""Replay results pinned to the values of an earlier release: speed-ups of the cache
(tree walk, LRU, allocator) must not change a single eviction decision."""

import pytest

from kvtier.sim import SimConfig, simulate, synthetic

# (device, host, storage) hit blocks, computed by kvtier at f423016 (before the tree's later speed-ups)
PINNED = {"write_through": (1810, 918, 352), "write_through_selective": (1810, 829, 0),
          "write_back": (1810, 1200, 374)}


@pytest.mark.parametrize("policy", sorted(PINNED))
def test_replay_hits_are_those_of_the_reference_release(policy):
    reqs = synthetic(sessions=120, turns=5, system_prompts=4, user_blocks=3, block_tokens=1, seed=7)
    r = simulate(reqs, SimConfig(device_tokens=40, host_tokens=90, storage_tokens=150, block_tokens=1,
                                 write_policy=policy))
    assert (r.device_hit, r.host_hit, r.storage_hit) == PINNED[policy]
