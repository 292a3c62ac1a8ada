"""Hand-made traces with known answers, bounds, the oracle, malformed input."""

import json

import pytest

from kvtier.sim import Request, SimConfig, TraceError, belady_hits, read_mooncake, simulate, synthetic


def trace(*prompts, bt=1):
    return [Request(float(i), len(p) * bt, 1, tuple(p)) for i, p in enumerate(prompts)]


def run(prompts, **cfg):
    cfg.setdefault("block_tokens", 1)
    r = simulate(trace(*prompts), SimConfig(**cfg))
    return (r.device_hit, r.host_hit, r.storage_hit, r.bound)


def test_shared_prefixes_hit_on_the_device():
    assert run([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5]], device_tokens=100, host_tokens=100) == (0 + 2 + 3, 0, 0, 5)


@pytest.mark.parametrize("policy, host_hit", [("write_through", 2), ("write_back", 2),
                                              ("write_through_selective", 0)])
def test_demotion_per_write_policy(policy, host_hit):
    # [1,2,3] fills the device; [4,5] evicts exactly its last two blocks (to the host unless no copy
    # exists); [1,2,3,6] finds block 1 on the device and the rest wherever it went
    got = run([[1, 2, 3], [4, 5], [1, 2, 3, 6]], device_tokens=3, host_tokens=10, write_policy=policy)
    assert got == (1, host_hit, 0, 3)


def test_storage_catches_what_device_and_host_dropped():
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8], [1, 2, 9]]
    assert run(prompts, device_tokens=2, host_tokens=2, storage_tokens=float("inf")) == (0, 0, 2, 2)
    assert run(prompts, device_tokens=2, host_tokens=2, storage_tokens=0) == (0, 0, 0, 2)
    assert run(prompts, device_tokens=2, host_tokens=2, storage_tokens=4) == (0, 0, 0, 2)  # LRU storage lost it


def test_bound_counts_only_previously_seen_prefix_blocks():
    # block ids are prefix hashes (as in Mooncake's traces): an id never moves to another position
    assert run([[1, 2], [3, 4], [1, 2, 5], [1, 6]], device_tokens=100, host_tokens=100)[3] == 0 + 0 + 2 + 1


def test_partial_last_block_is_never_reused_and_tokens_scale_by_block():
    reqs = [Request(0.0, 1000, 1, (1, 2)), Request(1.0, 1024, 1, (1, 2))]
    r = simulate(reqs, SimConfig(device_tokens=8 * 512, host_tokens=8 * 512))
    assert (r.device_hit, r.bound, r.prompt_tokens) == (512, 512, 2024)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_is_never_below_lru(seed):
    reqs = synthetic(sessions=30, turns=4, system_prompts=3, block_tokens=1, seed=seed)
    for device, host in ((4, 4), (8, 16), (16, 48)):
        r = simulate(reqs, SimConfig(device_tokens=device, host_tokens=host, block_tokens=1))
        oracle = belady_hits(reqs, device + host, 1)
        assert r.device_hit + r.host_hit <= oracle <= r.bound


def test_cost_model_prices_compute_and_copies():
    r = simulate(trace([1, 2], [1, 2, 3], bt=1000),
                 SimConfig(device_tokens=10_000, host_tokens=10_000, block_tokens=1000))
    assert r.prefill_s_without == pytest.approx(5000 / 10_000)
    assert r.prefill_s_with == pytest.approx(3000 / 10_000)  # device hits are free


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "line 2: missing hash_ids"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}', "input_length must be"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids must be a list"),
    ("[1, 2]", "expected an object"),
])
def test_malformed_lines_name_their_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message):
        read_mooncake(path)


@pytest.mark.parametrize("line, block_tokens, message", [
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', 512,
     r"line 2: 2 hash_ids for input_length 1025; 512-token blocks need ceil\(1025 / 512\) = 3"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', 16, "need ceil.0 / 16. = 0"),
    ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}', 16, "timestamp must be a finite"),
])
def test_lines_are_checked_against_the_block_size(tmp_path, line, block_tokens, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message):
        read_mooncake(path, block_tokens=block_tokens)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n\n\xc3(\n')
    with pytest.raises(TraceError, match=r"line 3: not UTF-8 \(byte 0xc3 at offset 0\)"):
        read_mooncake(path)


def test_cli_json_sweep_and_plot(tmp_path, capsys):
    from kvtier.cli import main

    trace_path = tmp_path / "t.jsonl"
    trace_path.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024 * len(p), "output_length": 4,
                                              "hash_ids": p}) + "\n"
                                  for i, p in enumerate([[1, 2], [1, 2, 3], [1, 4], [1, 2, 3, 5]])))
    plot = tmp_path / "sim.png"
    code = main(["simulate", str(trace_path), "--block-tokens", "1024", "--device-tokens", "4096",
                 "--host-tokens", "1e4", "--sweep", "host-tokens=2048,8192", "--oracle", "--plot", str(plot),
                 "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["host_tokens"] for r in rows] == [2048, 8192]
    assert all(r["bound"] == 1024 * (2 + 1 + 3) for r in rows)
    assert rows[1]["hit"] == rows[1]["bound"] and rows[1]["oracle"]["device+host"] >= rows[1]["hit"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_replays_are_deterministic(policy):
    # backups and storage writes run on worker threads; the replay must not depend on their timing
    reqs = synthetic(sessions=40, turns=4, system_prompts=3, block_tokens=1, seed=5)
    config = SimConfig(device_tokens=24, host_tokens=48, storage_tokens=64, block_tokens=1, write_policy=policy)
    runs = [simulate(reqs, config).as_dict() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0]["device_hit"] and runs[0]["host_hit"] + runs[0]["storage_hit"]


def test_sim_storage_evicts_least_recently_used_keys():
    from kvtier.sim.store import SimStorage

    st = SimStorage(3)
    st.batch_set(["a", "b", "c"], None, None)
    assert st.batch_get(["a", "x"], None, None) == [True, False]  # a is now the most recent
    st.batch_set(["d"], None, None)
    assert st.batch_exists(["a"]) == 1 and st.batch_exists(["b"]) == 0 and len(st) == 3
    st.batch_set(["c", "e", "f"], None, None)  # c refreshed: a goes, then d
    assert [st.batch_exists([k]) for k in "acde"] == [0, 1, 0, 1]
    unlimited = SimStorage()
    unlimited.batch_set([str(i) for i in range(1000)], None, None)
    assert unlimited.batch_exists([str(i) for i in range(1000)] + ["x"]) == 1000
