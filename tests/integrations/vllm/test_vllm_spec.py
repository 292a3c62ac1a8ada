"""The spec as vLLM builds it: one object per process role. The worker's spec creates
the rank's pool file, a separate scheduler-side spec maps it and builds the tier, and
nothing passes between them but the pool file and the jobs' page numbers. Bad
configurations fail at construction with one line naming what to change."""

import os

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import torch  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvtier.integrations.vllm import KVTierOffloadingSpec, UnsupportedVLLMSetupError  # noqa: E402
from kvtier.integrations.vllm.region import region_path  # noqa: E402
from tests.support.vllm_rig import CPU_GQA, Engine, context, gpu_spec, keys, offloading_config  # noqa: E402


@pytest.mark.parametrize("extra, message", [
    ({"host_bytes": 1 << 20, "host_byte": 1}, "unknown kv_connector_extra_config keys \\['host_byte'\\] "
                                                 "\\('host_byte': did you mean 'host_bytes'\\?\\)"),
    ({}, "needs host_bytes"),
    ({"host_bytes": -1}, "host_bytes must be a positive int"),
    ({"host_bytes": 1 << 20, "storage": "ftp://x/y"}, "unknown storage scheme 'ftp'"),
    ({"host_bytes": 1 << 20, "storage": "file://host/dir"}, "use file:///absolute/path"),
    ({"host_bytes": 1 << 20, "storage": "nonsense"}, "storage must be a URL"),
    ({"host_bytes": 100}, "holds no offloaded block"),
    ({"host_bytes": 1 << 20, "storage_buffer_bytes": 0}, "storage_buffer_bytes must be a positive int"),
    ({"host_bytes": 1 << 20, "host_dir": "relative/dir"}, "host_dir must be an absolute directory"),
])
def test_bad_extra_config_fails_at_construction_on_one_line(extra, message):
    with pytest.raises(ValueError, match=message) as err:
        KVTierOffloadingSpec(offloading_config(extra, block_bytes=3 * 8192))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, says", [({"pp_size": 2}, "pipeline parallel size 2"),
                                      ({"dcp_size": 2}, "context parallel sizes"),
                                      ({"groups": 0}, "no offloadable KV cache group")])
def test_unsupported_setups_say_what_to_change(kw, says):
    with pytest.raises(UnsupportedVLLMSetupError, match=says):
        KVTierOffloadingSpec(offloading_config({"host_bytes": 1 << 20}, **kw))


def test_vllm_factory_loads_the_spec_by_module_path():
    """vLLM's factory test, for kvtier: spec_module_path names the class, the spec keeps
    the config and vLLM's normalised block geometry, replicates nothing."""
    config = offloading_config({"host_bytes": 1 << 20}, blocks_per_chunk=3)
    spec_cls = OffloadingSpecFactory.get_spec_cls(config.extra_config)
    assert spec_cls is KVTierOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, KVTierOffloadingSpec) and spec.config is config
    assert spec.tokens_per_block == (32,) and spec.blocks_per_chunk == 3 and spec.replicated_layout is False
    assert "vllm:kv_offload_cpu_cache_usage_perc" in spec_cls.build_metric_definitions(config.extra_config)
    assert "vllm:kv_offload_tiering_read_bytes" in spec_cls.build_metric_definitions({"storage": "file:///x"})


def _pair(tmp_path, **extra):
    """A worker-side spec and a separate scheduler-side spec of one engine."""
    extra = {"host_bytes": 1 << 20, "host_dir": str(tmp_path / "shm"), **extra}
    (tmp_path / "shm").mkdir(exist_ok=True)
    return (KVTierOffloadingSpec(offloading_config(extra, engine_id="e1")),
            KVTierOffloadingSpec(offloading_config(extra, engine_id="e1")))


def test_scheduler_spec_maps_the_workers_pool_file_and_stores_through_it(tmp_path):
    worker_spec, scheduler_spec = _pair(tmp_path)
    engine = Engine(CPU_GQA)
    worker = worker_spec.get_worker(engine.caches)
    path = region_path(tmp_path / "shm", "e1", 0)
    assert path.is_file() and os.stat(path).st_mode & 0o777 == 0o600
    manager = scheduler_spec.get_manager()
    tier = manager.tier
    assert tier is not None and worker_spec.tier is None  # the tier lives with the scheduler only
    assert not path.exists()  # both sides mapped it: the file is gone, the memory stays
    ks = keys("a", "b")
    before = engine.blocks([5, 6])
    out = manager.prepare_store(ks, context())
    assert worker.submit_store(1, gpu_spec([5, 6]), out.store_spec)
    manager.complete_store(ks, context())
    # the scheduler's view of the pool holds the bytes the worker copied (storage reads them there)
    pages = torch.as_tensor(out.store_spec.pages)
    for name in tier.format.spec.names:
        assert tier.pool.page_views[name].all_layers.data_ptr() != worker.pool.page_views[name].all_layers.data_ptr()
        assert torch.equal(tier.pool.page_views[name].all_layers[pages], worker.pool.page_views[name].all_layers[pages])
    engine.wipe([5, 6])
    spec = manager.prepare_load(ks, context())
    assert worker.submit_load(2, spec, gpu_spec([9, 10]))
    manager.complete_load(ks, context())
    for layer, want in zip(engine.kv, before):
        assert torch.equal(layer[[9, 10]], want)
    worker.shutdown()
    manager.shutdown()


def test_a_manager_without_its_workers_pool_files_refuses_to_start(tmp_path):
    """vLLM builds its workers' KV caches before its scheduler: a pool file missing then
    is a worker on another machine, which kvtier cannot serve; never a silent no-op."""
    worker_spec, scheduler_spec = _pair(tmp_path)
    with pytest.raises(UnsupportedVLLMSetupError, match=r"no host pool file of worker\(s\) \[0\] of 1 in .*shm"):
        scheduler_spec.get_manager()
    two = KVTierOffloadingSpec(offloading_config({"host_bytes": 1 << 20, "host_dir": str(tmp_path / "shm")},
                                                 engine_id="e1", world_size=2))
    worker_spec.get_worker(Engine(CPU_GQA).caches)  # rank 0 here, rank 1 elsewhere
    with pytest.raises(UnsupportedVLLMSetupError, match=r"worker\(s\) \[1\] of 2"):
        two.get_manager()


def test_tier_keys_name_the_model_its_format_and_block_span(tmp_path):
    worker_spec, scheduler_spec = _pair(tmp_path, storage=f"file://{tmp_path}/store")
    worker_spec.get_worker(Engine(CPU_GQA).caches)
    tier = scheduler_spec.get_manager().tier
    assert tier.key_prefix == f"vllm%3A%2Fmodels%2Ftiny-llama%40unversioned%3Abfloat16/{tier.format.name}"
    named = KVTierOffloadingSpec(offloading_config({"host_bytes": 1 << 20, "namespace": "team-a/llama"}))
    assert named.namespace() == "team-a/llama"


def test_a_group_of_several_block_sizes_is_refused_saying_what_to_do(tmp_path):
    """A state cache group (Mamba keeps several tensors per layer) has blocks of several
    sizes: refused by name before any pool file exists."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    from kvtier.errors import UnsupportedLayoutError

    worker_spec, _ = _pair(tmp_path)
    tensors = [CanonicalKVCacheTensor(torch.zeros(4, n, dtype=torch.int8), n) for n in (4096, 1024)]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, 4096), CanonicalKVCacheRef(1, 1024)]])
    with pytest.raises(UnsupportedLayoutError, match=r"blocks of \[1024, 4096\] bytes .*without kvtier"):
        worker_spec.get_worker(caches)
    assert list((tmp_path / "shm").iterdir()) == []
