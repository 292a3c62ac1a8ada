"""``kvtier simulate`` on hybrid specs: the replay runs the hybrid cache (windows kept
per resume point) and crosses process boundaries intact."""

from __future__ import annotations

import pytest

from kvtier.hybrid import gpt_oss, mimo_v2_flash
from kvtier.sim.parallel import Replay
from kvtier.sim.simulator import SimConfig, simulate
from kvtier.sim.traces import Request
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


def _trace(*prompts, bt):
    return [Request(float(i), len(p) * bt, 1, tuple(p)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("prompts, device, host, storage", [
    # [1,2,3] fills the device; [4,5] moves it to the host; [1,2,3,6] resumes from there
    ([[1, 2, 3], [4, 5], [1, 2, 3, 6]], 3, 10, 0),
    # device and host hold two blocks each: [1,2] is back from storage by the last request
    ([[1, 2], [3, 4], [5, 6], [7, 8], [1, 2, 9]], 2, 2, float("inf")),
])
def test_a_hybrid_replay_prices_each_copied_hit_with_the_window_it_resumes_with(prompts, device, host, storage):
    spec = mimo_v2_flash()
    r = simulate(_trace(*prompts, bt=512), SimConfig(device * 512, host * 512, storage, spec=spec, sliding_ratio=1.0))
    copied, stored = r.host_hit + r.storage_hit, r.storage_hit
    assert copied and (stored > 0) == (storage > 0)  # one request of each trace copies its hit
    full, window = spec.full_bytes_per_token, spec.window_bytes
    moved = (copied * full + window) / 25e9 + ((stored * full + window) / 5e9 if stored else 0)
    assert r.prefill_s_with == pytest.approx((r.prompt_tokens - r.hit) / 10_000 + moved, rel=1e-12)
    assert window / 25e9 > 1e-4 * r.prefill_s_with  # so a window left unpriced fails the line above


def test_a_hybrid_replay_task_crosses_the_wire_intact():
    config = SimConfig(1000, 2000, 0, 512, spec=mimo_v2_flash(), sliding_ratio=0.5, window_blind=False,
                       retention_interval=4096)
    assert read_task(task_line(Replay(config))).config == config
