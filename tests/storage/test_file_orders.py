"""File backend: the orders of a page file's parts. A ``page_first`` pool writes slot
order and a ``page_first_direct`` pool layer order (a part per component, its page's
own bytes), a ``page_head`` pool split order (a part per component and head group,
each component's groups in turn), and each reads its own in place; ``layer_first``
pools write head order (a part per head group); every layout and every
tensor-parallel size reads any order, bit-exactly, and a damaged part is a miss."""

import struct
from pathlib import Path

import pytest
import torch
import xxhash

import kvtier.storage
from kvtier import Component, KVSpec
from kvtier.layout import LAYOUTS
from kvtier.storage import pageio
from kvtier.storage.pagefile import ALIGN, HEAD, LAYER, SLOT, SPLIT, OtherOrder
from tests.support.pools import SPECS, bits
from tests.support.services import unavailable
from tests.support.storage import blank_host, filled_host, flat_pages, shard_flat

SPEC = SPECS["asym"]  # K 4 heads x 12, V 4 heads x 8: head order has 4 parts, slot and layer order 2
COMPONENT_ORDERS = ["page_first", "page_first_direct"]  # the layouts that write a part per component
IN_PLACE = {"page_first": SLOT, "page_first_direct": LAYER, "page_head": SPLIT}  # the orders read in place
WITH_REP = KVSpec(2, (Component("k", 4, 12), Component("v", 4, 8), Component("idx", 1, 6)), torch.bfloat16)


def keys_for(n, namespace="o"):
    return kvtier.storage.page_keys(list(range(4 * n)), 4, namespace=namespace)


def the_file(store, key) -> Path:
    path, = store._key_files(key)
    return Path(path)


def header_fields(data: bytes) -> tuple[int, int, int, int]:
    """(version, part count, header length, order) of a page file's header."""
    _, version, parts, header_len, order = struct.unpack_from("<4sHHII", data)
    return version, parts, header_len, order


@pytest.mark.parametrize("layout, order, parts", [("page_first", SLOT, 2), ("page_head", SPLIT, 8),
                                                  ("layer_first", HEAD, 4), ("page_first_direct", LAYER, 2)])
def test_each_layout_writes_the_order_it_holds_contiguously(tmp_path, layout, order, parts):
    """A page_first or page_first_direct page's file holds, after its header, each
    component's page span byte for byte (at 4 KiB boundaries), each part's xxh3-64 in
    the header; a page_head page's, each component's head groups in turn (split
    order), each group's heads as the pool holds them; layer_first writes a part per
    head group."""
    host, idx = filled_host(SPEC, 2, layout=layout, seed=1)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(2)
    assert store.batch_set(keys, host, idx) == [True, True]
    for page, key in enumerate(keys):
        data = the_file(store, key).read_bytes()
        version, count, header_len, got_order = header_fields(data)
        assert (version, count, header_len, got_order) == (4, parts, ALIGN, order)
        if order == HEAD:
            continue
        spans = []
        for comp in ("k", "v"):
            view = host.page_views[comp].np_all_layers[idx[page * 4].item() // 4]  # (slot, layer, head, dim)
            if order == SPLIT:  # each head group (one head here) as (head, slot, layer, dim)
                spans += [view[:, :, h:h + 1].transpose(2, 0, 1, 3).tobytes() for h in range(view.shape[2])]
            else:
                spans.append((view if order == SLOT else view.transpose(1, 0, 2, 3)).tobytes())
        offset = end = header_len
        name_len = struct.unpack_from("<H", data, 24)[0]
        sums = struct.unpack_from(f"<{parts}Q", data, 26 + name_len)
        for i, span in enumerate(spans):
            if i:
                assert not any(data[end:offset]), "zeros between parts"
            assert data[offset:offset + len(span)] == span, i
            assert sums[i] == xxhash.xxh3_64_intdigest(span)
            end = offset + len(span)
            offset = -(-end // ALIGN) * ALIGN
        assert len(data) == end  # the last part ends the file


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("writer", ["page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("spec", [SPEC, WITH_REP, SPECS["mla"]], ids=["asym", "with_rep", "mla"])
def test_every_layout_reads_files_of_either_order(tmp_path, monkeypatch, writer, spec, native):
    """Files of the reader's own order move in place or staged; of the other order on
    the per-file path: all bit-exact, with the compiled loops and without."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    host, idx = filled_host(spec, 3, layout=writer, seed=2)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(3)
    assert store.batch_set(keys, host, idx) == [True] * 3
    for layout in LAYOUTS:
        reader, ridx = blank_host(spec, 16, layout=layout)
        ridx = ridx[:12].view(-1, 4).flip(0).reshape(-1)  # other pages, other order
        assert store.batch_get(keys, reader, ridx) == [True] * 3, layout
        assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx))), layout
    assert store.stats()["errors"] == 0


@pytest.mark.parametrize("layout", list(IN_PLACE))
def test_a_pool_reads_its_own_orders_files_in_place_with_the_compiled_reader(tmp_path, monkeypatch, layout):
    """Slot-order files go straight into a page_first pool, layer-order ones into a
    page_first_direct pool, split-order ones into a page_head pool: the compiled reader
    reads every one (no per-file path, no staging copy) bit-exactly."""
    if not pageio.compiled():
        unavailable("kvtier.storage._pageio is not built or bound, or KVTIER_NATIVE=0")
    seen, real = [], pageio.read_pages
    monkeypatch.setattr(pageio, "read_pages", lambda *a, **k: seen.append(a) or real(*a, **k))
    host, idx = filled_host(SPEC, 4, seed=3, layout=layout)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(4)
    assert store.batch_set(keys, host, idx) == [True] * 4
    per_file = []
    monkeypatch.setattr(store, "_get_page", lambda *a: per_file.append(a) or False)
    reader, ridx = blank_host(SPEC, 16, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True] * 4
    assert per_file == [] and seen
    assert all(len(piece) == 3 for _, _, _, _, parts, *_ in seen for _, _, pieces in parts for piece in pieces), \
        "every piece in place"
    assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))


@pytest.mark.parametrize("layout", list(IN_PLACE))
@pytest.mark.parametrize("native", ["1", "0"])
def test_a_damaged_per_component_part_is_a_miss_and_is_deleted(tmp_path, monkeypatch, native, layout):
    """A part of a slot-, layer- or split-order file damaged: that page misses (read in
    place, so its pool page may hold what was read), is counted corrupt and deleted;
    the others load."""
    monkeypatch.setenv("KVTIER_NATIVE", native)
    host, idx = filled_host(SPEC, 4, seed=4, layout=layout)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(4)
    assert store.batch_set(keys, host, idx) == [True] * 4
    for key, where in ((keys[1], ALIGN + 7), (keys[2], 2 * ALIGN + 100)):  # in K's part, in V's part
        victim = the_file(store, key)
        data = bytearray(victim.read_bytes())
        data[where] ^= 0x20
        victim.write_bytes(bytes(data))
    reader, ridx = blank_host(SPEC, 16, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True, False, False, True]
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    assert torch.equal(pages[0], want[0]) and torch.equal(pages[3], want[3])
    assert store.stats()["corrupt"] == 2 and store._key_files(keys[1]) == store._key_files(keys[2]) == []


def shards_read_their_heads(store, keys, truth, layout):
    """Ranks of 2 and of 4 of ``WITH_REP`` in ``layout`` each read every key, bit-exactly
    their own heads of the pages ``truth``."""
    for size in (2, 4):
        for rank in range(size):
            reader, ridx = blank_host(WITH_REP.shard(rank, size), 12, layout=layout)
            assert store.batch_get(keys, reader, ridx) == [True] * 3, (rank, size)
            for got, want in zip(flat_pages(reader, ridx), truth):
                assert torch.equal(got, bits(shard_flat(want.view(WITH_REP.dtype), WITH_REP, 4, rank, size)))


@pytest.mark.parametrize("writer", COMPONENT_ORDERS)
@pytest.mark.parametrize("layout", ["page_first", "page_head", "page_first_direct"])
def test_shards_read_their_heads_of_a_full_writers_per_component_file(tmp_path, layout, writer):
    """A full page_first (page_first_direct) writer leaves one slot-order (layer-order)
    file a page: K's and V's parts with all heads, then the replicated part. Ranks of 2
    and of 4 read the parts whole and keep their own heads, bit-exactly; a damaged byte
    of any head is a miss for every rank (each reads the whole part)."""
    full, idx = filled_host(WITH_REP, 3, seed=9, layout=writer)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(3)
    assert store.batch_set(keys, full, idx) == [True] * 3
    truth = flat_pages(full, idx)
    shards_read_their_heads(store, keys, truth, layout)
    victim = the_file(store, keys[1])
    data = bytearray(victim.read_bytes())
    data[ALIGN + 3 * 2 * 12 + 1] ^= 0x01  # K of head 3, slot 0, layer 0 (either order): rank 1's (of 2)
    victim.write_bytes(bytes(data))
    reader, ridx = blank_host(WITH_REP.shard(0, 2), 12, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True, False, True]
    assert store.stats()["corrupt"] == 1 and not victim.exists()


@pytest.mark.parametrize("layout", ["page_first", "page_head", "layer_first", "page_first_direct"])
def test_shards_read_their_groups_of_a_full_writers_split_file(tmp_path, layout):
    """A full page_head writer leaves one split-order file a page: K's four head groups,
    V's four, then the replicated part. Ranks of 2 and of 4 read their groups' parts
    of each component, bit-exactly; a damaged byte of head 3's K part is a miss for the
    rank that holds head 3, and the other rank of 2 still hits."""
    full, idx = filled_host(WITH_REP, 3, seed=9, layout="page_head")
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(3)
    assert store.batch_set(keys, full, idx) == [True] * 3
    victim = the_file(store, keys[1])
    assert header_fields(victim.read_bytes())[:2] == (4, 9)
    truth = flat_pages(full, idx)
    shards_read_their_heads(store, keys, truth, layout)
    data = bytearray(victim.read_bytes())
    data[4 * ALIGN + 1] ^= 0x01  # the fourth part: K of head group 3 (one head), rank 1's of 2
    victim.write_bytes(bytes(data))
    reader, ridx = blank_host(WITH_REP.shard(0, 2), 12, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True] * 3  # rank 0 reads none of head 3
    assert store.stats()["corrupt"] == 0
    reader, ridx = blank_host(WITH_REP.shard(1, 2), 12, layout=layout)
    assert store.batch_get(keys, reader, ridx) == [True, False, True]
    assert store.stats()["corrupt"] == 1 and not victim.exists()


@pytest.mark.parametrize("writer", list(IN_PLACE))
@pytest.mark.parametrize("reader_layout", ["page_first", "page_head", "layer_first", "page_first_direct"])
def test_a_full_reader_joins_the_per_component_files_of_two_shards(tmp_path, reader_layout, writer):
    """Two page_first (page_first_direct, page_head) ranks write their halves in slot
    (layer, split) order, rank 0 with the replicated part; a full reader of any layout
    finds both files and puts each part's heads in place, bit-exactly; ranks of 4 read
    their quarter out of a half."""
    full, idx = filled_host(WITH_REP, 3, seed=6)
    truth = flat_pages(full, idx)
    store = kvtier.storage.open(f"file://{tmp_path}")
    keys = keys_for(3)
    for rank in range(2):
        shard = WITH_REP.shard(rank, 2)
        host, hidx = blank_host(shard, 12, layout=writer)
        for i, s in enumerate(hidx[::4].tolist()):
            host.set_from_flat_data_page(s, shard_flat(truth[i].view(WITH_REP.dtype), WITH_REP, 4, rank, 2))
        assert store.batch_set(keys, host, hidx) == [True] * 3
    files = [Path(p) for p in store._key_files(keys[0])]
    assert sorted(f.name.rsplit(".", 1)[1] for f in files) == ["g0-2of4+rep", "g2-4of4"]
    assert [header_fields(f.read_bytes())[3] for f in files] == [IN_PLACE[writer]] * 2
    reader, ridx = blank_host(WITH_REP, 12, layout=reader_layout)
    assert store.batch_get(keys, reader, ridx) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(truth, flat_pages(reader, ridx)))
    for rank in range(4):
        quarter, qidx = blank_host(WITH_REP.shard(rank, 4), 12, layout=reader_layout)
        assert store.batch_get(keys, quarter, qidx) == [True] * 3
        for i, got in enumerate(flat_pages(quarter, qidx)):
            assert torch.equal(got, bits(shard_flat(truth[i].view(WITH_REP.dtype), WITH_REP, 4, rank, 4)))
    assert store.stats()["errors"] == 0


def test_a_file_of_another_order_is_never_judged_corrupt(tmp_path):
    """A reader that expects one order meets a file of another of the same size and
    name: it reads it in that order, deletes nothing (every writer, every reader)."""
    spec = KVSpec.mha(2, 2, 64)  # every order: a 4 KiB header and 16 KiB of parts (two or four)
    layouts = ("page_head", "page_first", "page_first_direct")
    stores = {}
    for layout in layouts:
        host, idx = filled_host(spec, 2, page_size=16, layout=layout, seed=7)
        store = stores[layout] = kvtier.storage.open(f"file://{tmp_path / layout}")
        keys = kvtier.storage.page_keys(list(range(32)), 16, namespace="x")
        assert store.batch_set(keys, host, idx) == [True] * 2
        for reader_layout in layouts:
            reader, ridx = blank_host(spec, 32, page_size=16, layout=reader_layout)
            assert store.batch_get(keys, reader, ridx) == [True] * 2
            assert all(torch.equal(a, b) for a, b in zip(flat_pages(reader, ridx), flat_pages(host, idx)))
    sizes = {layout: [the_file(s, k).stat().st_size for k in keys] for layout, s in stores.items()}
    assert sizes["page_head"] == sizes["page_first"] == sizes["page_first_direct"]
    assert all(s.stats()["corrupt"] == 0 and s.stats()["errors"] == 0 for s in stores.values())
    assert [header_fields(the_file(stores[layout], keys[0]).read_bytes())[3] for layout in layouts] == [SPLIT, SLOT,
                                                                                                        LAYER]


def test_a_file_that_changes_order_while_read_is_a_counted_miss_that_stays(tmp_path, monkeypatch):
    """Read in the other order, a file that names yet another order (it was replaced
    between the two reads) is a miss and a counted error, never an exception, and it
    is not deleted; the batch's other pages load."""
    monkeypatch.setenv("KVTIER_NATIVE", "0")  # the per-file path, where the orders are judged
    host, idx = filled_host(SPEC, 3, layout="page_head", seed=8)
    store = kvtier.storage.open(f"file://{tmp_path}", io_threads=1)  # one step: the pages after it are read too
    keys = keys_for(3)
    assert store.batch_set(keys, host, idx) == [True] * 3
    victim = the_file(store, keys[1])
    real = store._read_source

    def replaced_meanwhile(path, *args):
        if path == str(victim) and args[5] == SPLIT:  # the second read, in the file's own order
            raise OtherOrder(SLOT)
        return real(path, *args)

    monkeypatch.setattr(store, "_read_source", replaced_meanwhile)
    reader, ridx = blank_host(SPEC, 12)  # page_first: expects slot order, meets split order
    assert store.batch_get(keys, reader, ridx) == [True, False, True]
    pages, want = flat_pages(reader, ridx), flat_pages(host, idx)
    assert torch.equal(pages[0], want[0]) and torch.equal(pages[2], want[2])
    stats = store.stats()
    assert (stats["errors"], stats["corrupt"]) == (1, 0) and victim.exists()
