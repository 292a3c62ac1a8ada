"""The model's identity in storage keys: two checkpoints never read each other's KV.

A namespace names the checkpoint — name or path, revision, dtype — and, where the
integration can read the weights, a digest of them, so that two fine-tunes of one
architecture (same name, same config) still differ. The KV geometry is not part of
it: storage object names carry the spec's fingerprint themselves.
"""

from __future__ import annotations

import torch
import xxhash

_CHUNK = 64 << 20  # bytes hashed per step: bounds the host copy of a device tensor


def weights_digest(module: torch.nn.Module) -> str:
    """xxh3-128 over every parameter and buffer (name, dtype, shape, bytes), in
    ``state_dict`` order. Device tensors are copied to the host a chunk at a time."""
    h = xxhash.xxh3_128()
    for name, t in module.state_dict().items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        raw = flat.contiguous().view(torch.uint8)
        for start in range(0, raw.numel(), _CHUNK):
            h.update(raw[start:start + _CHUNK].cpu().numpy().tobytes())
    return h.hexdigest()


def model_namespace(name: str, revision: str | None, dtype: torch.dtype, digest: str | None) -> str:
    """``<name>@<revision>:<dtype>[:w<digest>]``, the namespace kvtier's integrations
    use when none is given."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty str, got {name!r}")
    out = f"{name}@{revision or 'unversioned'}:{str(dtype).removeprefix('torch.')}"
    return f"{out}:w{digest[:32]}" if digest else out
