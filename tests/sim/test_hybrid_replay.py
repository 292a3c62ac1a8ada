"""``kvtier simulate`` on hybrid specs: the replay runs the hybrid cache (windows kept
per resume point) and crosses process boundaries intact."""

from __future__ import annotations

from kvtier.hybrid import gpt_oss, mimo_v2_flash
from kvtier.sim.parallel import Replay
from kvtier.sim.simulator import SimConfig, simulate
from kvtier.sim.traces import synthetic
from kvtier.sim.wire import read_task, task_line


def test_an_unbounded_hybrid_replay_hits_what_a_window_blind_one_does_but_first_branches():
    requests = synthetic(sessions=40, block_tokens=512, seed=1)
    spec = mimo_v2_flash()
    hybrid = simulate(requests, SimConfig(10 ** 8, 10 ** 8, spec=spec, sliding_ratio=1.0))
    blind = simulate(requests, SimConfig(10 ** 8, 10 ** 8, spec=spec, window_blind=True))
    assert blind.hit <= blind.bound and hybrid.hit <= blind.hit
    # the hybrid cache only misses where a prefix is first shared (no window kept there yet)
    assert hybrid.hit >= 0.9 * blind.hit > 0


def test_sliding_pools_too_small_for_the_windows_lose_hits_but_never_break():
    requests = synthetic(sessions=40, block_tokens=512, seed=2)
    spec = gpt_oss(24)
    roomy = simulate(requests, SimConfig(64 * 512, 256 * 512, spec=spec, sliding_ratio=1.0))
    tight = simulate(requests, SimConfig(64 * 512, 256 * 512, spec=spec, sliding_ratio=0.02))
    assert tight.hit < roomy.hit


def test_retention_points_keep_shared_prefixes_resumable():
    requests = synthetic(sessions=40, block_tokens=512, seed=3)
    spec = mimo_v2_flash()
    ends = simulate(requests, SimConfig(10 ** 8, 10 ** 8, spec=spec, sliding_ratio=1.0))
    every = simulate(requests, SimConfig(10 ** 8, 10 ** 8, spec=spec, sliding_ratio=1.0, retention_interval=512))
    blind = simulate(requests, SimConfig(10 ** 8, 10 ** 8, spec=spec, window_blind=True))
    assert ends.hit <= every.hit == blind.hit  # a window at every block: nothing is lost to windows


def test_a_hybrid_replay_task_crosses_the_wire_intact():
    config = SimConfig(1000, 2000, 0, 512, spec=mimo_v2_flash(), sliding_ratio=0.5, window_blind=False,
                       retention_interval=4096)
    assert read_task(task_line(Replay(config))).config == config
