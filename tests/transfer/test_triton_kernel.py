"""The Triton page-copy kernel, run by Triton's interpreter on CPU tensors (no GPU needed):
the same geometry x layout x page-size matrix as the core round trips, both directions."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

from tests.support import ROOT  # noqa: E402
from tests.support.pools import LAYOUT_ORDERS, SPECS  # noqa: E402

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from kvtier import HostKVPool
    from kvtier.transfer import triton_kernel
    from tests.support.pools import LAYOUT_ORDERS, SPECS, bits, random_device_pool

    failures, runs = [], 0
    for spec_name, spec in SPECS.items():
        for layout in LAYOUT_ORDERS:
            for ps in (1, 16):
                dev = random_device_pool(spec, 8 * ps, ps, seed=1)
                out = random_device_pool(spec, 8 * ps, ps, seed=2)
                before = {{n: [bits(out.buffer(n, l)).clone() for l in range(spec.layer_num)] for n in spec.names}}
                host = HostKVPool(spec, 6 * ps, ps, layout=layout)
                hp, dp, lp = torch.tensor([4, 1, 2, 0]), torch.tensor([7, 3, 4, 0]), torch.tensor([5, 2, 6, 1])
                for n in spec.names:  # backup: every layer of each page in one launch per component
                    triton_kernel.copy_pages(host.page_views[n].all_layers, dev.page_views[n].all_layers, hp, dp)
                for n in spec.names:
                    for layer in range(spec.layer_num):  # load: one layer per launch
                        triton_kernel.copy_pages(out.page_views[n].layers[layer], host.page_views[n].layers[layer],
                                                 lp, hp)
                for n in spec.names:
                    for layer in range(spec.layer_num):
                        runs += 1
                        got, src = bits(out.buffer(n, layer)), bits(dev.buffer(n, layer))
                        for page in range(8):
                            want = (src[dp[lp.tolist().index(page)] * ps:][:ps] if page in lp.tolist()
                                    else before[n][layer][page * ps:(page + 1) * ps])
                            if not torch.equal(got[page * ps:(page + 1) * ps], want):
                                failures.append((spec_name, layout, ps, n, layer, page))
    print("RESULT", runs, len(failures), failures[:5])
""")


def test_kernel_round_trips_every_geometry_and_layout_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")][-1].split(maxsplit=3)
    runs, failures = int(result[1]), int(result[2])
    assert runs == sum(len(s.names) * s.layer_num for s in SPECS.values()) * len(LAYOUT_ORDERS) * 2
    assert failures == 0, result[3]


def test_block_size_follows_the_page_size():
    from kvtier.transfer.triton_kernel import block_size

    assert block_size(16 * 1 * 64) == 1024          # a small page: one block, not many tiny ones
    assert block_size(10) == 128 and block_size(1 << 20) == 4096
