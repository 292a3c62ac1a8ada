import hashlib

import numpy as np
import pytest
import torch

from kvtier.storage import page_keys
from kvtier.storage.keys import extend_keys


def test_one_key_per_full_page_and_chained():
    tokens = list(range(10))
    keys = page_keys(tokens, 4, namespace="m")
    assert len(keys) == 2 and all(k.startswith("m/") for k in keys)
    assert page_keys(tokens[:8], 4, namespace="m") == keys
    changed = page_keys([99] + tokens[1:], 4, namespace="m")
    assert changed[0] != keys[0] and changed[1] != keys[1], "key 1 must depend on page 0"
    later = page_keys(tokens[:4] + [99] + tokens[5:], 4, namespace="m")
    assert later[0] == keys[0] and later[1] != keys[1]


def test_first_key_is_sha256_of_namespace_and_salt_then_tokens():
    parent = hashlib.sha256(b"\0".join([b"kvtier-page-v1", b"sha256", (1).to_bytes(4, "little") + b"m", b""])).digest()
    want = hashlib.sha256(parent + np.arange(4, dtype="<i8").tobytes()).hexdigest()
    assert page_keys([0, 1, 2, 3], 4, namespace="m") == [f"m/{want}"]


def test_namespaces_and_salts_isolate():
    t = list(range(8))
    variants = [page_keys(t, 4, namespace="a"), page_keys(t, 4, namespace="b"),
                page_keys(t, 4, namespace="a", salt="tenant-1"), page_keys(t, 4, namespace="a", salt="tenant-2"),
                page_keys(t, 4, namespace="a", hash="xxh3")]
    digests = {k.split("/")[-1] for keys in variants for k in keys}
    assert len(digests) == 10



def test_a_salt_is_one_tenant_in_every_spelling_and_nothing_else_is_a_salt():
    """``None``, ``""`` and ``b""`` are the default tenant and ``"t"``/``b"t"`` one other,
    as the cache's tree has them. An int or a bool names no tenant: ``ValueError`` (before,
    ``0`` and ``False`` shared the default tenant's keys and ``7`` raised ``TypeError``)."""
    t = list(range(8))
    assert page_keys(t, 4, salt=None) == page_keys(t, 4, salt="") == page_keys(t, 4, salt=b"")
    assert page_keys(t, 4, salt="t") == page_keys(t, 4, salt=b"t") == page_keys(t, 4, salt=bytearray(b"t"))
    for bad in (0, False, 7, 1.5):
        with pytest.raises(ValueError, match=f"salt must be None, str or bytes, got {type(bad).__name__}"):
            page_keys(t, 4, salt=bad)
        with pytest.raises(ValueError, match="salt must be"):
            extend_keys(None, t, 4, salt=bad)

def test_input_types_agree_and_namespace_is_escaped():
    t = [5, 6, 7, 8]
    ref = page_keys(t, 2, namespace="meta-llama/Llama 3")
    assert ref[0].startswith("meta-llama%2FLlama%203/")
    assert page_keys(np.array(t, dtype=np.int32), 2, namespace="meta-llama/Llama 3") == ref
    assert page_keys(torch.tensor(t), 2, namespace="meta-llama/Llama 3") == ref
    assert len(page_keys(t, 2, hash="xxh3")[0].split("/")[-1]) == 32


@pytest.mark.parametrize("args, match", [
    (([1, 2], 0), "page_size"),
    (([[1, 2]], 1), "1-D"),
    (([1.5, 2.0], 1), "ints"),
    (([1, 2], 1, ""), "namespace"),
    (([1, 2], 1, "m", None, "md5"), "unknown hash 'md5'"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        page_keys(*args)


def test_extend_keys_continues_a_chain():

    tokens = list(range(20))
    full = page_keys(tokens, 4, namespace="m", salt="s")
    assert extend_keys(full[1], tokens[8:], 4, namespace="m", salt="s") == full[2:]
    assert extend_keys(None, tokens, 4, namespace="m", salt="s") == full


# Keys written by earlier kvtier versions must still find their objects: these digests were
# computed before any speed-up of the key chain and must never change.
PINNED = [
    ((list(range(6)), 2, "meta-llama/Llama-3", "t", "sha256"),
     ["meta-llama%2FLlama-3/5e5b5ff978d3ad4206bd18ea4d461e3f09294d793e78ae06015a9aec4b7bf38c",
      "meta-llama%2FLlama-3/68524ecf5172994eebee4a8b32dabb9277114cd7224a6510ef480be276f8245b",
      "meta-llama%2FLlama-3/62b32988d000a252d116c7e4601caeebced03aff129cebf50372d7320de21b9f"]),
    (([7, 1 << 40, -3], 1, "sim", None, "sha256"),
     ["sim/244fb81e521549dd9eae6cc04bc393d6eb3303fee38f3fa5817ef163e469929d",
      "sim/486f109d642464ad561003d373c075d7039d2dfc5feae7c09ae4934de4ac07e8",
      "sim/18ffec80074f812189237d594235cdd119f08182181a3c44a7aef79bfb773eb9"]),
    (([5, 6, 7], 1, "m", b"\x00\xff", "sha256"),
     ["m/bea0168d288941435b3e27e426e271e67e48cd29e4d72dd3ef826d9f8bb9a17a",
      "m/1609a0c8154468af9ea3e5f19aabcf8753e7b9ab2a41fe147ef4c4afbfe3401e",
      "m/f964ba2f62439fea7888a2cb716e69abb9695b56178d93f5053f9b4d36862373"]),
    ((list(range(8)), 4, "m", None, "xxh3"),
     ["m/3b1a88795f297be795bedb122d498235", "m/da8f84be0c29ff1b889a78bffaf83ad5"]),
]


@pytest.mark.parametrize("args, want", PINNED)
def test_known_key_values_never_change(args, want):
    from array import array

    tokens, page_size, namespace, salt, hash = args
    for form in (tokens, array("q", tokens), np.array(tokens, dtype=np.int64), torch.tensor(tokens)):
        assert page_keys(form, page_size, namespace=namespace, salt=salt, hash=hash) == want
    for i in range(1, len(want)):  # continuing the chain from any key gives the same tail
        tail = form[i * page_size:]
        assert extend_keys(want[i - 1], tail, page_size, namespace, salt, hash) == want[i:]


def test_the_keys_check_names_each_bad_key_as_one_by_one():
    from kvtier.storage.base import MAX_KEY_BYTES, _check_keys

    good = [f"ns:{i:032x}" for i in range(5)]
    assert _check_keys(good) == good and _check_keys(good) is not good  # a list of its own
    assert _check_keys(tuple(good)) == good
    long_ok = ["x" * MAX_KEY_BYTES]  # one key at the limit: fits
    assert _check_keys(long_ok) == long_ok
    two_long = ["x" * 40_000, "y" * 40_000]  # each fits, together over the limit: still fine
    assert _check_keys(two_long) == two_long
    assert _check_keys(["é" * 10, *good]) == ["é" * 10, *good]

    class Key(str):
        pass
    assert _check_keys([Key("a"), "b"]) == ["a", "b"]
    for keys, match in (([*good, ""], "key 5 is ''"), ([*good, 7], "key 5 is 7"), ([b"ab", *good], "key 0 is b'ab'"),
                        ([*good, "x" * (MAX_KEY_BYTES + 1)], "key 5 is 65536 bytes"),
                        ([*good, "é" * 40_000], "key 5 is 80000 bytes"), (["\ud800"], "not encodable")):
        with pytest.raises(ValueError, match=match):
            _check_keys(keys)
