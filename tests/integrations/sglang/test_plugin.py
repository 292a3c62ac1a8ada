"""kvtier's sglang plugin, loaded by sglang's own ``load_plugins()`` in a fresh process
(as each sglang scheduler process does) from an entry point of ``sglang.srt.plugins``."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from kvtier.integrations.sglang.plugin import mode_from_env  # noqa: E402

HERE = Path(__file__).parent

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import conftest  # noqa: F401 - the torchvision stand-in
    from sglang.srt.plugins import load_plugins
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    import torch
    load_plugins()
    def choice(v_head_dim):
        pool = MHATokenToKVPool(size=16, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=1,
                                device="cpu", enable_memory_saver=False, v_head_dim=v_head_dim)
        return hpa.get_mha_host_pool_cls(pool.get_device_pool_infos()[0].buffer_info).__name__
    print(choice(8), choice(16))
""")


def run_with_entry_point(tmp_path, **env):
    dist = tmp_path / "kvtier_plugin_probe-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-plugin-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkvtier_host_pool = kvtier.integrations.sglang.plugin:load\n")
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), **env}
    out = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE))], env=child_env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-2:]


@pytest.mark.parametrize("mode, expected", [
    (None, ["KVTierMHAHostPool", "MHATokenToKVPoolHost"]),
    ("all", ["KVTierMHAHostPool", "KVTierMHAHostPool"]),
    ("off", ["AsymmetricMHATokenToKVPoolHost", "MHATokenToKVPoolHost"]),
])
def test_sglangs_load_plugins_installs_kvtier_host_pools(mode, expected, tmp_path):
    env = {} if mode is None else {"KVTIER_SGLANG_HOST_POOL": mode}
    assert run_with_entry_point(tmp_path, **env) == expected


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="KVTIER_SGLANG_HOST_POOL='sometimes'"):
        mode_from_env({"KVTIER_SGLANG_HOST_POOL": "sometimes"})
    assert mode_from_env({}) == "asymmetric"
