"""What crosses to ``--jobs`` workers is JSON that round-trips exactly (no pickle)."""

import pytest
import torch

from kvtier.sim import SimConfig, simulate, synthetic
from kvtier.sim.simulator import CostModel
from kvtier.sim.wire import (Oracle, Replay, read_result, read_task, read_trace, result_line, task_line,
                             trace_line)
from kvtier.spec import KVSpec

CONFIGS = [
    SimConfig(device_tokens=4096, host_tokens=8192),
    SimConfig(device_tokens=10, host_tokens=20, storage_tokens=float("inf"), block_tokens=1,
              write_policy="write_back", spec=KVSpec.mha(4, 2, 192, v_head_dim=128, dtype=torch.float16),
              cost=CostModel(1234.5, 0.1 + 0.2, 7.0)),
    SimConfig(device_tokens=10, host_tokens=20, storage_tokens=33.0, spec=KVSpec.mla(61, 512, 64)),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_replay_tasks_round_trip(config):
    assert read_task(task_line(Replay(config))) == Replay(config)


def test_oracle_tasks_results_and_traces_round_trip():
    for task in (Oracle(float("inf"), 512), Oracle(4096.0, 64)):
        assert read_task(task_line(task)) == task
    reqs = synthetic(sessions=5, turns=3, block_tokens=1, seed=2)
    assert read_trace(trace_line(reqs)) == reqs
    result = simulate(reqs, CONFIGS[1])
    assert read_result(result_line(result)) == result and read_result(result_line(17)) == 17


def test_a_task_naming_something_that_is_not_a_dtype_is_refused():
    line = task_line(Replay(CONFIGS[0])).replace('"bfloat16"', '"Tensor"')
    with pytest.raises(ValueError, match="not a torch dtype"):
        read_task(line)
