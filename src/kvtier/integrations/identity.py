"""The model's identity in storage keys: two checkpoints never read each other's KV.

A namespace names the checkpoint — name or path, revision, dtype — and a digest of
its weights, so that two fine-tunes of one architecture (same name, same config)
still differ, and a checkpoint overwritten in place never reads the KV of the
weights it replaced. The KV geometry is not part of it: storage object names carry
the spec's fingerprint themselves.

Two digests: :func:`weights_digest` hashes a loaded module's tensors (the Hugging
Face integration holds the model); :func:`checkpoint_digest` reads only file
metadata, for engines that load the weights themselves (vLLM, sglang) and must name
them cheaply at start, whatever the checkpoint's size.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import torch
import xxhash

from ..errors import UsageError

_CHUNK = 64 << 20  # bytes hashed per step: bounds the host copy of a device tensor
#: Files whose bytes are the model: weights in the formats engines load, and the config
#: (rope scaling, window sizes and the like change the KV of the same weights).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
CONFIG_FILES = ("config.json", "params.json")
_MAX_CONFIG_BYTES = 16 << 20
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header


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
        raise UsageError(f"model name must be a non-empty str, got {name!r}")
    out = f"{name}@{revision or 'unversioned'}:{str(dtype).removeprefix('torch.')}"
    return f"{out}:w{digest[:32]}" if digest else out


def _safetensors_header(path: Path, size: int) -> bytes:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets), or
    b"" when the file is not one: 8 bytes of little-endian length, then the header."""
    if size < 8:
        return b""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _MAX_HEADER_BYTES):
            return b""
        return f.read(n)


def _model_files(root: Path) -> list[Path]:
    """Weight and config files in ``root`` and its first level of folders, sorted."""
    out = []
    for folder in (root, *sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))):
        for p in folder.iterdir():
            if p.name in CONFIG_FILES or p.name.endswith(WEIGHT_SUFFIXES):
                out.append(p)
    return sorted(out)


def directory_digest(root: str | os.PathLike) -> str | None:
    """xxh3-128 over a checkpoint directory's weight files — relative name, size,
    modification time in ns and, for safetensors, the header naming every tensor — and
    the bytes of its config files; ``None`` when ``root`` holds no such file.

    Reads no weight bytes, so it costs a ``stat`` and one small read per file even for a
    checkpoint of hundreds of GB. Writing weights (``save_pretrained`` to the same path,
    a copy, a re-download) changes the times, so KV of the old weights is never read;
    untouched files keep their digest across restarts. Symbolic links (the hub cache's
    snapshots) are followed."""
    root = Path(root)
    h = xxhash.xxh3_128()
    files = _model_files(root)
    for p in files:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            continue
        rel = p.relative_to(root).as_posix()
        h.update(f"{rel}|{st.st_size}|{st.st_mtime_ns}|".encode())
        if p.name in CONFIG_FILES and st.st_size <= _MAX_CONFIG_BYTES:
            h.update(p.read_bytes())
        elif p.name.endswith(".safetensors"):
            h.update(_safetensors_header(p, st.st_size))
    return h.hexdigest() if files else None


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local snapshot folder of a hub model (its name is the resolved commit), from
    the hub cache only: nothing is downloaded. ``None`` if not cached or no hub client."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for name in CONFIG_FILES:
        try:
            found = try_to_load_from_cache(repo_id, name, revision=revision)
        except Exception:  # an id that is not a repo name, a broken cache: no snapshot
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def checkpoint_digest(name_or_path: str, revision: str | None = None) -> tuple[str | None, str | None]:
    """``(revision, digest)`` naming the checkpoint an engine loads from ``name_or_path``.

    A local directory: ``revision`` as given and :func:`directory_digest` of it. A hub id:
    the commit its cached snapshot resolves to (else ``revision``), and the digest of
    that snapshot. Anything else (no such folder, not cached): ``(revision, None)``."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_dir():
        return revision, directory_digest(path)
    snapshot = hub_snapshot(name_or_path, revision)
    if snapshot is None:
        return revision, None
    return snapshot.name, directory_digest(snapshot)


def engine_namespace(engine: str, name_or_path: str, revision: str | None, dtype) -> str:
    """``<engine>:<name>@<revision>:<dtype>:w<digest>``: the default namespace of an
    engine integration (vLLM, sglang) that loads weights from ``name_or_path``."""
    revision, digest = checkpoint_digest(name_or_path, revision)
    return f"{engine}:" + model_namespace(name_or_path, revision, dtype, digest)
