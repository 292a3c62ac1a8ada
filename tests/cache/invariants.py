"""Whole-cache invariants checked after every step of the property and stress tests."""

from __future__ import annotations

from engine import check_prefix


def tokens_of(node) -> list[int]:
    out = []
    for n in node.path():
        out += n.key
    return out


def check_invariants(cache, engine_device_slots: int = 0) -> None:
    nodes = list(cache.tree.nodes())
    dev_slots, host_slots = [], []
    for node in nodes:
        assert node.device is not None or node.host is not None, f"{node} holds nothing but is in the tree"
        if node.device is not None:
            assert node.parent.parent is None or node.parent.device is not None, "device copies not prefix-closed"
            dev_slots += node.device.tolist()
        if node.host is not None:
            host_slots += node.host.tolist()
        assert len(node.key) % cache.page_size == 0 and node.key
    assert len(dev_slots) == len(set(dev_slots)), "a device slot is owned by two nodes"
    assert len(host_slots) == len(set(host_slots)), "a host slot is owned by two nodes"
    dev, host = cache.device_pool, cache.host_pool
    assert dev.available_size() + len(dev_slots) + engine_device_slots == dev.size, "device slots leaked"
    assert host.available_size() + len(host_slots) == host.size, "host slots leaked"
    for node in nodes:
        if node.device is not None and node.loading is None:
            full = tokens_of(node)
            start = len(full) - len(node.key)
            prefix_slots = [n.device for n in node.path()]
            import torch

            check_prefix(cache, full, torch.cat(prefix_slots))
            assert start >= 0
