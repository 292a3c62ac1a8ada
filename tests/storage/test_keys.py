import hashlib

import numpy as np
import pytest
import torch

from kvtier.storage import page_keys


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
    from kvtier.storage.keys import extend_keys

    tokens = list(range(20))
    full = page_keys(tokens, 4, namespace="m", salt="s")
    assert extend_keys(full[1], tokens[8:], 4, namespace="m", salt="s") == full[2:]
    assert extend_keys(None, tokens, 4, namespace="m", salt="s") == full
