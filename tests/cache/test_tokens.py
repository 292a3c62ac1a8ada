"""Token ids from lists and tuples: the compiled reader (``kvtier.cache._tokens``) and
the pure path give the same arrays and the same errors. When the reader is not built
its own tests are skipped, or fail under KVTIER_REQUIRE_SERVICES=1 (CI)."""

from __future__ import annotations

import platform
import random
import sys
from array import array

import numpy as np
import pytest
import torch

from kvtier.cache import tokens
from kvtier.compiled import load
from tests.support.memory import capsule_tensor, left_after
from tests.support.services import unavailable

INT64 = (-(1 << 63), (1 << 63) - 1)


@pytest.fixture
def compiled():
    """The compiled module ``kvtier.cache._tokens``."""
    module = load(tokens.COMPILED)
    if module is None:
        unavailable("kvtier.cache._tokens is not built (no C compiler at install time?) or KVTIER_NATIVE=0")
    return module


@pytest.fixture(params=["compiled", "pure"])
def path(request, monkeypatch):
    if request.param == "compiled":
        request.getfixturevalue("compiled")
    else:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    return request.param


def _cases():
    rng = random.Random(3)
    ids = [rng.randrange(-(1 << 40), 1 << 40) for _ in range(1000)]
    return [[], [0], ids, tuple(ids), [*INT64, -1, 1, 255, 256], [True, False, 7], [np.int64(5), 6],
            [np.int32(-3)] * 4]


@pytest.mark.parametrize("ids", _cases(), ids=range(len(_cases())))
def test_both_paths_give_the_ids_as_int64(path, ids):
    out = tokens.token_array(ids)
    assert isinstance(out, array) and out.typecode == "q"
    assert out.tolist() == [int(i) for i in ids]


class _Ids(list):
    pass


class _Array(array):
    pass


@pytest.mark.parametrize("kind", ["array", "array subclass", "array('i')", "list subclass", "range", "generator",
                                  "tensor", "(1, n) tensor", "numpy"])
def test_every_kind_of_sequence_gives_a_copy_of_its_ids(path, kind):
    ids = [3, -1, 1 << 40, 7]
    given = {"array": lambda: array("q", ids), "array subclass": lambda: _Array("q", ids),
             "array('i')": lambda: array("i", [3, -1, 5, 7]), "list subclass": lambda: _Ids(ids),
             "range": lambda: range(3, 11, 2), "generator": lambda: (i for i in ids),
             "tensor": lambda: torch.tensor(ids), "(1, n) tensor": lambda: torch.tensor([ids]),
             "numpy": lambda: np.array(ids)}[kind]()
    want = list(given) if kind in ("array('i')", "range") else ids
    out = tokens.token_array(given)
    assert type(out) is array and out.typecode == "q" and out.tolist() == want and out is not given
    if kind in ("array", "array subclass"):
        given[0] = 99  # the caller's array changes; the copy does not
        assert out[0] == 3


@pytest.mark.parametrize("ids, message", [
    ([1, 1 << 63], "outside the int64 range"),
    ([-(1 << 63) - 1], "outside the int64 range"),
    ([1, 2.0], "element of type float"),
    ([1, "2"], "element of type str"),
    ((None, 1), "element of type NoneType"),
])
def test_both_paths_refuse_the_same_ids(path, ids, message):
    with pytest.raises(ValueError, match=message):
        tokens.token_array(ids)


@pytest.mark.parametrize("given", [
    torch.tensor([4, 5, 6], requires_grad=False), torch.tensor([[4, 5, 6]]), torch.tensor([4, 5, 6], dtype=torch.int32),
    torch.tensor([4, 0, 5, 0, 6])[::2], np.array([4, 5, 6], dtype=np.uint64), np.array([[4, 5, 6]], dtype=np.int16),
    np.array([4, 0, 5, 0, 6])[::2],
], ids=["tensor", "(1, n) tensor", "int32 tensor", "strided tensor", "uint64", "(1, n) int16", "strided"])
def test_tensors_and_numpy_arrays_give_a_copy_of_their_ids(given):
    out = tokens.token_array(given)
    assert type(out) is array and out.tolist() == [4, 5, 6]
    given[..., 0] = 9  # the caller's buffer changes; the copy does not
    assert out[0] == 4


@pytest.mark.parametrize("given, message", [
    (np.zeros((2, 2), dtype=np.int64), r"1-D or \(1, n\), got a numpy array of dtype int64 of shape \(2, 2\)"),
    (torch.zeros(2, 3, dtype=torch.long), r"got a tensor of dtype torch.int64 of shape \(2, 3\)"),
    (np.zeros(3, dtype=np.float32), "must hold integers, got a numpy array of dtype float32"),
    (torch.zeros(3, requires_grad=True), "must hold integers, got a tensor of dtype torch.float32"),
    (np.array([1, 1 << 63], dtype=np.uint64), "outside the int64 range"),
])
def test_tensors_and_numpy_arrays_are_refused_with_their_dtype_and_shape(given, message):
    with pytest.raises(ValueError, match=message):
        tokens.token_array(given)


def test_the_compiled_reader_is_built(compiled):
    """CI builds it: a missing one fails there instead of silently testing the pure path only."""
    out = array("q", [0]) * 3
    assert compiled.fill_int64(out, [1, -2, 3]) is True and out.tolist() == [1, -2, 3]


def test_the_compiled_reader_answers_false_for_what_it_does_not_read(compiled):
    for ids in ([1, True], [1, 1 << 64], [np.int64(1)], [1.0]):
        assert compiled.fill_int64(array("q", [0]) * len(ids), ids) is False


@pytest.mark.parametrize("n", range(1, 14))
def test_the_compiled_reader_reads_every_position_the_same(compiled, n):
    """It reads four ids a step (one test for the four where each is one positive digit),
    then two, then the last one alone: every position of every step reads each kind of id
    (0, negative, more digits, the one-digit bounds) and answers False for a non-int."""
    rng = random.Random(n)
    odds = ((-(1 << 40) - 3, True), (1 << 62, True), (-1, True), (0, True), (5, True), (1 << 30, True),
            ((1 << 30) - 1, True), (-(1 << 30) + 1, True), (-(1 << 63), True), (True, False), (2.0, False),
            (1 << 63, False))
    for at in range(n):
        for odd, want in odds:
            ids = [rng.randrange(1, 1 << 30) for _ in range(n)]
            ids[at] = odd
            out = array("q", [7]) * n
            assert compiled.fill_int64(out, ids) is want, (n, at, odd)
            if want:
                assert out.tolist() == ids


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or sys.implementation.name != "cpython"
                    or not (3, 11) <= sys.version_info[:2] <= (3, 13), reason="the one-load test is built for "
                    "x86-64 CPython 3.11-3.13, whose int layouts it knows")
def test_the_compiled_reader_tests_one_digit_ids_in_one_load(compiled):
    """The import checks the int layout on ints it makes and turns the one-load test off
    where it differs: on the CPythons it is built for, it must find it the same."""
    assert compiled.one_digit_test == 1


def test_the_compiled_reader_checks_its_arguments(compiled):
    with pytest.raises(ValueError, match="3 ids need 24 bytes, the buffer holds 16"):
        compiled.fill_int64(array("q", [0, 0]), [1, 2, 3])
    with pytest.raises(TypeError, match="list or a tuple"):
        compiled.fill_int64(array("q", [0]), iter([1]))
    with pytest.raises((TypeError, BufferError)):
        compiled.fill_int64(b"\0" * 8, [1])  # read-only
    with pytest.raises((TypeError, ValueError, BufferError)):
        compiled.fill_int64(np.zeros(4, dtype=np.int64)[::2], [1, 2])  # not contiguous


def _tree_of(prompts, page_size):
    from kvtier.cache.radix import RadixTree

    tree = RadixTree(page_size)
    root = tree.root(b"")
    for p in prompts:
        tokens = array("q", p[:len(p) - len(p) % page_size])
        path, pos, inner = tree.walk(tokens, b"")
        if path and inner < len(path[-1].key):
            path[-1] = tree.split(path[-1], inner)
        if pos < len(tokens):
            tree.add_child(path[-1] if path else root, tokens[pos:])
    return tree


def test_the_compiled_walk_run_is_the_python_one(compiled):
    """``walk_run`` and ``RadixTree._run`` stop at the same place on the same node with
    the same path and stamps, from every start: prompts sharing prefixes of every
    length, runs ending inside keys, at ``usable`` and past the tokens' end."""
    from kvtier.cache.radix import RadixTree

    rng = random.Random(5)
    base = [rng.randrange(40) for _ in range(64)]
    prompts = [base[:rng.randrange(0, 64)] + [rng.randrange(40) for _ in range(rng.randrange(0, 24))]
               for _ in range(50)]
    tree = _tree_of(prompts, 4)
    starts = [(tree.root(b""), 0)] + [(n, n.depth) for n in tree.nodes()]
    lengths, reached = set(), set()
    for ids in map(lambda p: array("q", p), prompts + [base]):
        for node, pos in starts:
            for usable in {len(ids) - len(ids) % 4, pos + 4, pos}:
                if not pos <= usable <= len(ids):
                    continue
                got, want = [], []
                for run, path, stamp in ((compiled.walk_run, got, 7), (RadixTree._run, want, 9)):
                    out = run(node, ids, pos, -3, usable, path, stamp)
                    assert [n.last_access for n in path] == [stamp] * len(path)
                    if run is compiled.walk_run:
                        first = out
                assert first == out and got == want
                lengths.add(len(got))
                reached.update(map(id, got))
    assert len(lengths) > 3 and len(reached) > 10, (lengths, len(reached))  # walks of many lengths


def test_the_compiled_walk_run_checks_its_arguments(compiled):
    tree = _tree_of([[1, 2, 3, 4, 5, 6, 7, 8]], 4)
    root, tokens = tree.root(b""), array("q", [1, 2, 3, 4, 5, 6, 7, 8])
    assert compiled.walk_run(root, tokens, 0, 0, 8, [], None)[:2] == (8, 8)
    assert compiled.walk_run(root, tokens, 0, 0, 4, [], None)[:2] == (0, 0)  # the key runs past usable
    assert compiled.walk_run(root, tokens[:4], 0, 0, 4, [], None)[:2] == (0, 0)  # past the tokens: no read
    for pos, usable in ((-1, 8), (0, 9), (5, 4)):
        with pytest.raises(ValueError, match="0 <= pos <= usable"):
            compiled.walk_run(root, tokens, pos, 0, usable, [], None)
    with pytest.raises(ValueError, match="int64 buffer"):
        compiled.walk_run(root, b"\0" * 8, 0, 0, 1, [], None)
    with pytest.raises(TypeError, match="path must be a list"):
        compiled.walk_run(root, tokens, 0, 0, 8, (), None)
    with pytest.raises(TypeError, match="7 arguments"):
        compiled.walk_run(root, tokens, 0, 0, 8, [])
    child = next(iter(root.children.values()))
    child.key = b"\0" * 8
    with pytest.raises(TypeError, match="int64 buffer"):
        compiled.walk_run(root, tokens, 0, 0, 8, [], None)


def _on_device(tree, rng, page_size):
    """Every node of ``tree`` given device pages (random, distinct) except a few leaves
    and every node below them kept off the device; the nodes kept off, by id."""
    from kvtier.cache.residency import DeviceCopy

    off, pages = set(), iter(rng.sample(range(10 ** 6), 10 ** 4))
    for node in tree.nodes():
        if id(node.parent) in off or rng.random() < 0.15:
            off.add(id(node))
        else:
            node.device = DeviceCopy(np.array([next(pages) for _ in range(len(node.key) // page_size)]))
    return off


def _slots(capsule) -> list[int]:
    """A walk's slots: the DLPack capsule read by torch (once), as a list."""
    return capsule_tensor(capsule).tolist()


def test_walk_slots_is_the_walk_and_its_device_slots(compiled):
    """``RadixTree.walk_slots`` walks as ``walk`` does, from every prompt of a tree with
    first-id collisions, nodes off the device and walks ending inside a key; it gives
    the path's device slots exactly where ``walk``'s path is all on the device, matched
    whole, keyed by first ids (a collision's child is for the Python walk), and ends at
    the usable tokens or at a node with no child keyed by the next id and no collisions."""
    rng = random.Random(8)
    base = [rng.randrange(40) for _ in range(64)]
    prompts = [base[:rng.randrange(0, 64)] + [rng.randrange(40) for _ in range(rng.randrange(0, 24))]
               for _ in range(60)]
    tree = _tree_of(prompts, 4)
    off = _on_device(tree, rng, 4)
    assert any(n.collisions for n in tree.nodes())
    # each prompt cut a page short, and with its last page changed: walks that end
    # inside a key, where the Python walk goes on into the child the run could not take
    cut = [p[:len(p) - len(p) % 4 - 4] for p in prompts if len(p) >= 8]
    changed = [p[:len(p) - len(p) % 4 - 4] + [41] * 4 for p in prompts if len(p) >= 8]
    kinds = set()
    for ids in map(lambda p: array("q", p), prompts + cut + changed + [base, base[:5], [41] * 8, []]):
        for node in tree.nodes():
            node.last_access = 0
        got = tree.walk_slots(ids, b"", 7)
        stamps = [n.last_access for n in got[0]]
        want = tree.walk(ids, b"", 9)
        path, pos, inner = want
        assert got[:3] == want
        assert stamps == [7 if n is not path[-1] or inner == len(n.key) else 0 for n in path]  # as walk stamps
        whole = path and inner == len(path[-1].key) and not any(id(n) in off for n in path)
        stop = path[-1] if path else None
        over = pos == len(ids) - len(ids) % 4 or (stop is not None and ids[pos] not in stop.children
                                                  and not stop.collisions)
        over = over and all(isinstance(n.edge, int) for n in path)  # a collision's child: the Python walk's
        if whole and over:
            slots = np.concatenate([p * 4 + np.arange(4) for n in path for p in n.device.pages])
            assert got[3] is not None and np.array_equal(_slots(got[3]), slots)
            kinds.add("slots")
        else:
            assert got[3] is None
            kinds.add("off" if path and not whole else "on" if path else "none")
        if whole and not over:
            kinds.add("a child or collision to look at")
    assert kinds == {"slots", "off", "on", "none", "a child or collision to look at"}, kinds


def test_walk_slots_leaves_pages_it_cannot_read_to_the_caller(compiled):
    """A split's pieces give their slots as one run of their array, node by node where
    that run does not fit. Pages that are not int64 or not a node's share of the slots,
    and a node off the device above one on it, give no slots and no error; bad arguments
    are refused."""
    from kvtier.cache.residency import DeviceCopy

    tree = _tree_of([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]], 4)
    root, tokens = tree.root(b""), array("q", [1, 2, 3, 4, 5, 6, 7, 8])
    top = root.children[1]
    low = top.children[5]
    top.device, low.device = DeviceCopy(np.array([3])), DeviceCopy(np.array([6]))
    assert _slots(compiled.walk_slots(root, tokens, 8, [], None, 4)[3]) == \
        [12, 13, 14, 15, 24, 25, 26, 27]
    # the pieces of a split: views of one array, taken as one run of it
    base = np.array([9, 3, 6, 2])
    top.device, low.device = DeviceCopy(base[1:2], base, 1), DeviceCopy(base[2:3], base, 2)
    assert _slots(compiled.walk_slots(root, tokens, 8, [], None, 4)[3]) == \
        [12, 13, 14, 15, 24, 25, 26, 27]
    top.device.pages = np.array([5])  # not what the array holds: the run is read from the array itself
    assert _slots(compiled.walk_slots(root, tokens, 8, [], None, 4)[3])[:4] == \
        [12, 13, 14, 15]
    for first, at in ((1, 3), (1, 4), (3, 4), (1, "2")):  # longer than the path, out of the array, not an int
        top.device, low.device = DeviceCopy(base[1:2], base, first), DeviceCopy(base[2:3], base, at)
        assert _slots(compiled.walk_slots(root, tokens, 8, [], None, 4)[3]) == \
            [12, 13, 14, 15, 24, 25, 26, 27]  # node by node
    top.device = DeviceCopy(np.array([3]))
    for pages in (np.array([6.0]), np.array([6, 7]), np.array([6], dtype=np.int32)):
        low.device = DeviceCopy(pages)
        assert compiled.walk_slots(root, tokens, 8, [], None, 4)[3] is None
    low.device, top.device = DeviceCopy(np.array([6])), None
    assert compiled.walk_slots(root, tokens, 8, [], None, 4)[3] is None
    # a walk that ends inside a child's key (two pages, the prompt has one of them): the
    # run stops at that child, and the Python walk goes on into it
    deep = _tree_of([list(range(1, 13)), [1, 2, 3, 4, 9, 9, 9, 9]], 4)
    for node in deep.nodes():
        node.device = DeviceCopy(np.arange(len(node.key) // 4))
    inside = array("q", range(1, 9))
    assert compiled.walk_slots(deep.root(b""), inside, 8, [], None, 4)[3] is None
    assert deep.walk_slots(inside, b"", 1)[:3] == deep.walk(inside, b"") and deep.walk(inside, b"")[2] == 4
    # a collision's child left where the child keyed by its first id was removed: the
    # walk is not over at its parent (the Python walk goes on to it)
    top.device = DeviceCopy(np.array([3]))
    other = tree.add_child(top, array("q", [5, 8, 8, 8]))
    tree.remove(low)
    assert not isinstance(other.edge, int) and top.collisions
    ends = array("q", [1, 2, 3, 4, 5, 8, 8, 8])
    assert compiled.walk_slots(root, ends, 8, [], None, 4)[:2] == (4, 4)
    assert compiled.walk_slots(root, ends, 8, [], None, 4)[3] is None
    assert tree.walk_slots(ends, b"", 1)[:3] == ([top, other], 8, 4)
    for usable, page_size in ((-1, 4), (9, 4), (8, 0)):
        with pytest.raises(ValueError, match="0 <= usable"):
            compiled.walk_slots(root, tokens, usable, [], None, page_size)
    with pytest.raises(TypeError, match="empty list"):
        compiled.walk_slots(root, tokens, 8, [top], None, 4)
    with pytest.raises(TypeError, match="6 arguments"):
        compiled.walk_slots(root, tokens, 8, [], None)


def test_walk_slots_capsules_free_their_slots_once(compiled):
    """A walk's slots go with its capsule where no tensor was made of it, and with the
    tensor where one was (which outlives the capsule): nothing is left behind after
    hundreds of walks, and a tensor still reads its slots after the capsule is gone."""
    import gc

    from kvtier.cache.residency import DeviceCopy

    prompt = list(range(1, 4097))
    tree = _tree_of([prompt], 4)
    (node,) = tree.nodes()
    node.device = DeviceCopy(np.arange(1024, dtype=np.int64)[::-1].copy())
    tokens, root = array("q", prompt), tree.root(b"")
    want = (np.arange(1024)[::-1, None] * 4 + np.arange(4)).reshape(-1).tolist()
    tensor = capsule_tensor(compiled.walk_slots(root, tokens, 4096, [], None, 4)[3])
    gc.collect()
    assert tensor.tolist() == want  # the capsule is gone, the tensor's slots are not

    def walks():
        assert compiled.walk_slots(root, tokens, 4096, [], None, 4)[3] is not None  # dropped unread
        assert capsule_tensor(compiled.walk_slots(root, tokens, 4096, [], None, 4)[3])[5].item() == want[5]

    left = left_after(walks, 200)
    assert left < 4096 * 8, left  # less than one walk's slots (400 walks' would be 13 MB)


def test_the_radix_walk_matches_the_same_with_either_comparison(monkeypatch, compiled):
    """A tree walked with the compiled comparison and with array slices finds the same
    prefixes (prompts sharing prefixes of every length, in and out of page bounds)."""
    import torch

    from kvtier import DeviceKVPool, HierarchicalCache, HostKVPool, KVSpec

    rng = random.Random(6)
    spec = KVSpec.k_only(1, 1, 1, dtype=torch.float16)
    cache = HierarchicalCache(DeviceKVPool(spec, 4096, 4), HostKVPool(spec, 64, 4), write_policy="write_back")
    base = [rng.randrange(50) for _ in range(80)]
    prompts = [base[:rng.randrange(0, 80)] + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
               for _ in range(60)]
    for p in prompts[:40]:
        p = p[:len(p) - len(p) % 4]
        slots = cache.alloc_device(len(p))
        cache.free_device(slots[:cache.insert(p, slots)])
    found = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVTIER_NATIVE", flag)
        found[flag] = [cache.peek(p).device_len for p in prompts]
    assert found["1"] == found["0"]
    assert len(set(found["0"])) > 5
    cache.close()
