"""kvtier's sglang plugin, loaded by sglang's own ``load_plugins()`` in a fresh process
(as each sglang scheduler process does) from an entry point of ``sglang.srt.plugins``,
then sglang's server args published and its logging set up, in that order, as
``run_scheduler_process`` does before it builds the cache."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang")

from kvtier.integrations.sglang.plugin import mode_from_env  # noqa: E402

SGLANG_OWN = ["AsymmetricMHATokenToKVPoolHost", "MHATokenToKVPoolHost"]
KVTIER_ASYM = ["KVTierMHAHostPool", "MHATokenToKVPoolHost"]
TOOK_OVER = "kvtier took over sglang's host pool AsymmetricMHATokenToKVPoolHost: KVTierMHAHostPool"

CHILD = textwrap.dedent("""
    import json, logging, sys
    import tests.integrations.sglang.conftest  # noqa: F401 - the torchvision stand-in
    if {block_pool!r}:
        sys.modules["kvtier.integrations.sglang.host_pool"] = None  # kvtier's pool class fails to import
    from sglang.srt.plugins import load_plugins
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    import torch
    load_plugins()
    # NOTE: sglang configures its logging after load_plugins() (configure_logger's basicConfig)
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s: %(message)s", force=True)
    def choice(v_head_dim):
        pool = MHATokenToKVPool(size=16, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=1,
                                device="cpu", enable_memory_saver=False, v_head_dim=v_head_dim)
        try:
            return hpa.get_mha_host_pool_cls(pool.get_device_pool_infos()[0].buffer_info).__name__
        except Exception as e:
            print("RAISED", type(e).__name__, e, file=sys.stderr)
            return "raised"
    print("CHOICE", choice(8), choice(16), flush=True)
    for args in json.loads({published!r}):
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import prepare_server_args
        publish(prepare_server_args(args), role="scheduler")  # last publish wins
        print("CHOICE", choice(8), choice(16), flush=True)
""")


def child_env(tmp_path, **env) -> dict:
    """This environment with kvtier's entry point on the path (as installing kvtier registers it)."""
    dist = tmp_path / "kvtier_plugin_probe-0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-plugin-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkvtier_host_pool = kvtier.integrations.sglang.plugin:load\n")
    base = {k: v for k, v in os.environ.items() if k != "KVTIER_SGLANG_HOST_POOL"}
    return {**base, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
            **{k: v for k, v in env.items() if v is not None}}


def run_child(tmp_path, published=(), block_pool=False, **env) -> subprocess.CompletedProcess:
    script = CHILD.format(published=json.dumps([list(a) for a in published]), block_pool=block_pool)
    return subprocess.run([sys.executable, "-c", script], env=child_env(tmp_path, **env), capture_output=True,
                          text=True, timeout=600)


def choices(out) -> list[list[str]]:
    """The host-pool classes chosen for K/V widths 16/8 and 16/16: before any server args,
    then after each published set."""
    assert out.returncode == 0, out.stderr[-3000:]
    return [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("CHOICE ")]


def kvtier_lines(out) -> list[str]:
    """kvtier's log lines on the host pools (publishing server args sets up sglang's own log format)."""
    return [line for line in out.stderr.splitlines() if "kvtier took over" in line or "kvtier keeps" in line]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config sglang's server args resolve against (no weights: nothing is loaded)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-config")
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def server_args(model_dir, backend=None, config=None) -> list[str]:
    args = ["--model-path", str(model_dir), "--device", "cpu", "--enable-hierarchical-cache"]
    if backend:
        args += ["--hicache-storage-backend", backend]
    if config is not None:
        args += ["--hicache-storage-backend-extra-config", config if isinstance(config, str) else json.dumps(config)]
    return args


def kvtier_storage(module="kvtier.integrations.sglang", **extra) -> dict:
    return {"backend_name": "kvtier", "module_path": module, "class_name": "KVTierStorage", "interface_v1": 1,
            "url": "file:///nonexistent/kvtier", **extra}


@pytest.mark.parametrize("mode, expected", [
    (None, SGLANG_OWN),  # installing kvtier changes nothing unless asked
    ("", SGLANG_OWN),
    ("off", SGLANG_OWN),
    ("asymmetric", KVTIER_ASYM),
    (" All ", ["KVTierMHAHostPool", "KVTierMHAHostPool"]),
])
def test_sglangs_load_plugins_installs_kvtier_host_pools_only_when_asked(mode, expected, tmp_path):
    out = run_child(tmp_path, KVTIER_SGLANG_HOST_POOL=mode)
    assert choices(out) == [expected]
    lines = kvtier_lines(out)
    if expected == SGLANG_OWN:
        assert lines == []
    else:
        # the line comes when sglang picks the class, after sglang set up its logging
        assert any(line.startswith(f"LOG sglang.kvtier: {TOOK_OVER}") and
                   f"KVTIER_SGLANG_HOST_POOL={mode.strip().lower()}" in line for line in lines), lines


def test_kvtier_as_the_hicache_storage_backend_asks_for_its_host_pools(tmp_path, model_dir):
    """No KVTIER_SGLANG_HOST_POOL: kvtier's pools for asymmetric K/V exactly while the
    published server args make KVTierStorage the storage backend (either module path,
    the extra config inline or as sglang's ``@file``)."""
    config_file = tmp_path / "storage.json"
    config_file.write_text(json.dumps(kvtier_storage("kvtier.integrations.sglang.storage")))
    published = [server_args(model_dir, "dynamic", kvtier_storage()),
                 server_args(model_dir, "file"),
                 server_args(model_dir, "dynamic", f"@{config_file}"),
                 server_args(model_dir, "dynamic", {**kvtier_storage(), "class_name": "OtherStorage"}),
                 server_args(model_dir)]
    out = run_child(tmp_path, published)
    assert choices(out) == [SGLANG_OWN, KVTIER_ASYM, SGLANG_OWN, KVTIER_ASYM, SGLANG_OWN, SGLANG_OWN]
    lines = kvtier_lines(out)
    assert sum(TOOK_OVER in line and "kvtier is the HiCache storage backend" in line for line in lines) == 2, lines
    assert sum("keeps sglang's host pool MHATokenToKVPoolHost" in line for line in lines) == 2, lines


def test_off_wins_over_kvtier_as_the_storage_backend(tmp_path, model_dir):
    out = run_child(tmp_path, [server_args(model_dir, "dynamic", kvtier_storage())], KVTIER_SGLANG_HOST_POOL="off")
    assert choices(out) == [SGLANG_OWN, SGLANG_OWN]
    assert kvtier_lines(out) == []


def refusal(out) -> str:
    """The one line a refused start ends with; no traceback."""
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "CHOICE" not in out.stdout
    return out.stderr.strip().splitlines()[-1]


def test_an_unknown_mode_stops_sglang_at_load_plugins_with_one_line(tmp_path):
    """sglang's loader logs and skips a plugin's Exception; kvtier's refusal gets past it."""
    line = refusal(run_child(tmp_path, KVTIER_SGLANG_HOST_POOL="sometimes"))
    assert line.startswith("kvtier: KVTIER_SGLANG_HOST_POOL='sometimes' is not a kvtier host-pool mode"), line


def test_a_pool_class_that_cannot_be_installed_stops_sglang_with_one_line(tmp_path, model_dir):
    line = refusal(run_child(tmp_path, block_pool=True, KVTIER_SGLANG_HOST_POOL="all"))
    assert line.startswith("kvtier: KVTIER_SGLANG_HOST_POOL=all, but kvtier cannot install its host pool "
                           "KVTierMHAHostPool in sglang: ModuleNotFoundError"), line
    # asked through the storage backend: the factory raises when sglang builds the host pool
    out = run_child(tmp_path, [server_args(model_dir, "dynamic", kvtier_storage())], block_pool=True)
    assert choices(out) == [SGLANG_OWN, ["raised", "MHATokenToKVPoolHost"]]
    assert "RAISED RuntimeError kvtier cannot build its host pool KVTierMHAHostPool in place of sglang's " \
           "AsymmetricMHATokenToKVPoolHost (kvtier is the HiCache storage backend)" in out.stderr, out.stderr[-3000:]


def test_sglangs_launch_server_refuses_an_unknown_mode(tmp_path, model_dir):
    """The real server entry point stops at once, before it parses its arguments."""
    command = [sys.executable, "-m", "sglang.launch_server", *server_args(model_dir, "dynamic", kvtier_storage())]
    env = child_env(tmp_path, KVTIER_SGLANG_HOST_POOL="sometimes", SGLANG_USE_CPU_ENGINE="1")
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0, out.stderr[-3000:]
    named = [line for line in out.stderr.splitlines() if "sometimes" in line]
    assert len(named) == 1 and named[0].startswith("kvtier: KVTIER_SGLANG_HOST_POOL='sometimes'"), out.stderr[-3000:]
    assert "Failed to execute general plugin" not in out.stderr


def test_mode_from_env():
    with pytest.raises(ValueError, match="KVTIER_SGLANG_HOST_POOL='sometimes'"):
        mode_from_env({"KVTIER_SGLANG_HOST_POOL": "sometimes"})
    assert mode_from_env({}) is None and mode_from_env({"KVTIER_SGLANG_HOST_POOL": " "}) is None
    assert mode_from_env({"KVTIER_SGLANG_HOST_POOL": " All "}) == "all"
