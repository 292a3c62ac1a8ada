"""Prefix reuse for Hugging Face transformers decoder-only models, across requests.

Before a request, the prompt is matched in a :class:`kvtier.HierarchicalCache`; the
hit (from device, host or storage) is copied into a ``DynamicCache`` and the model
runs only on the missing tokens; afterwards the new full pages go back into the
cache. Works for any model whose cache layers hold per-layer ``keys``/``values``
tensors ``(batch, heads, seq, dim)`` — the geometry is read off those tensors, so K
and V may differ in heads and dims (MiMo-V2-Flash K 192 / V 128; DeepSeek-V3,
whose cache holds its MLA latent and rope key as two one-head tensors).

Sliding-window layers (``DynamicSlidingWindowLayer``: MiMo-V2-Flash, Gemma 2/3,
gpt-oss, Mistral, Cohere2, OLMo3, ...) make the spec a :class:`~kvtier.HybridSpec`:
one group per layer kind, window and shape. A sliding layer attends to the
``sliding_window - 1`` tokens before each query (transformers counts the query in
``sliding_window``), so that is the group's window ``W``. Restoring a prefix of
``P`` tokens gives a full layer all ``P`` and a sliding layer the last
``min(P, W)``, with its ``cumulative_length`` set to ``P``: the layer's positions
and mask depend on it. During a request the sliding layers record every state
(``activate_past_recording``), so the pages of any window the cache keeps can be
committed, not only the last ``W`` tokens a layer holds after its forward.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from ..cache import HierarchicalCache
from ..cache.tokens import token_array
from ..errors import UnsupportedModelError, UsageError
from ..hybrid import Attention, HybridSpec, KVGroup
from ..pools import DeviceKVPool, HostKVPool, HybridDevicePool, HybridHostPool
from ..spec import Component, KVSpec
from .identity import model_namespace, weights_digest


_FULL, _SLIDING = "DynamicLayer", "DynamicSlidingWindowLayer"


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _forward(model, input_ids: torch.Tensor, cache):
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=True, **{_cache_kwarg(model): cache})


def spec_from_model(model) -> KVSpec | HybridSpec:
    """The KV geometry of ``model``, read off the cache tensors of a one-token forward: a
    ``KVSpec`` when every layer is full attention of one shape, else a ``HybridSpec``
    with a group per (attention, window, shape): ``full``, ``swa``, then ``full1``,
    ``swa1``, ... for further ones."""
    cache = _new_cache(model)
    _forward(model, torch.zeros(1, 1, dtype=torch.long, device=model.device), cache)
    layers = getattr(cache, "layers", None)
    if not layers:
        raise UnsupportedModelError(f"{type(cache).__name__} exposes no per-layer keys/values")
    other = sorted({type(layer).__name__ for layer in layers} - {_FULL, _SLIDING})
    if other:
        raise UnsupportedModelError(f"cache layers {other} hold state kvtier cannot page (only {_FULL} and "
                                    f"{_SLIDING} are served)")
    keyed: dict[tuple, list[int]] = {}
    for i, layer in enumerate(layers):
        attention = Attention.sliding(layer.sliding_window - 1) if type(layer).__name__ == _SLIDING else Attention()
        shape = (layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[1], layer.values.shape[-1])
        keyed.setdefault((attention, shape, layer.keys.dtype), []).append(i)
    groups, seen = [], {}
    for (attention, (kh, kd, vh, vd), dtype), ids in keyed.items():
        base = "full" if attention.is_full else "swa"
        n = seen[base] = seen.get(base, -1) + 1
        spec = KVSpec(len(ids), (Component("k", kh, kd), Component("v", vh, vd)), dtype)
        groups.append(KVGroup(base if n == 0 else f"{base}{n}", tuple(ids), spec, attention))
    hybrid = HybridSpec(tuple(groups))
    return hybrid.uniform_spec if hybrid.is_uniform else hybrid


def hf_namespace(model) -> str:
    """The checkpoint's identity: ``hf:`` + name or path (the class name for a model
    built from a config), revision (the hub commit, when known), dtype and a digest
    of the weights (computed here, once)."""
    config = model.config
    name = getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or type(model).__name__
    revision = getattr(config, "_commit_hash", None) or getattr(config, "revision", None)
    return "hf:" + model_namespace(name, revision, model.dtype, weights_digest(model))


@dataclass
class RequestStats:
    prompt_tokens: int
    device_tokens: int      # reused from the device pool
    host_tokens: int        # reused after a host -> device load
    storage_tokens: int     # reused after a storage -> host prefetch and a load
    prefill_tokens: int     # computed by the model
    prefill_s: float        # match + prefetch + load + the model on the missing tokens
    output: list[int]
    first_logits: torch.Tensor  # (vocab,) logits that chose the first generated token


class CachedGenerator:
    """Greedy generation with KV reuse across requests through a HierarchicalCache."""

    def __init__(self, model, cache: HierarchicalCache, salt=None) -> None:
        self.model, self.cache = model, cache
        self.salt = salt  # the tenant of a call that names none
        self.spec = cache.device_pool.spec
        self.hybrid = isinstance(self.spec, HybridSpec)
        # per model layer: (its group, its index in the group); a plain spec is one group "kv"
        self._layers = [self.spec.group_of(i) for i in range(self.spec.layer_num)] if self.hybrid else None

    @classmethod
    def build(cls, model, *, device_tokens: int, host_tokens: int, page_size: int = 16, storage=None,
              layout: str = "page_first", write_policy: str = "write_through", namespace: str | None = None,
              salt=None, retention_interval: int | None = None,
              sliding_tokens: int | None = None) -> "CachedGenerator":
        """A generator over a new cache for ``model``. Sliding-window models get one pool
        per layer group; ``sliding_tokens`` sizes each sliding group's device and host
        pools (default: as the full groups'), ``retention_interval`` keeps a window
        every so many tokens (a multiple of ``page_size``) besides sequence ends and
        branch points. ``salt``: the tenant of every call that names none."""
        spec = spec_from_model(model)
        if namespace is None:
            namespace = hf_namespace(model) if storage is not None else None
        kw = dict(write_policy=write_policy, prefetch_policy="wait_complete", namespace=namespace)
        if isinstance(spec, HybridSpec):
            def sizes(tokens: int) -> dict[str, int]:
                return {g.name: tokens if g.attention.is_full or sliding_tokens is None else sliding_tokens
                        for g in spec.groups}
            device = HybridDevicePool(spec, sizes(device_tokens), page_size, device=model.device)
            host = HybridHostPool(spec, sizes(host_tokens), page_size, layout=layout)
            kw["retention_interval"] = retention_interval
        else:
            device = DeviceKVPool(spec, device_tokens, page_size, device=model.device)
            host = HostKVPool(spec, host_tokens, page_size, layout=layout)
        return cls(model, HierarchicalCache(device, host, storage, **kw), salt)

    # -- DynamicCache <-> pool ------------------------------------------------------------------
    def _pool_layer(self, layer: int):
        """``(pool, layer in the pool, attention)`` of model layer ``layer``."""
        if not self.hybrid:
            return self.cache.device_pool, layer, None
        group, local = self._layers[layer]
        return self.cache.device_pool[group.name], local, group

    def _to_dynamic(self, got):
        """A ``DynamicCache`` holding the acquired prefix: every token for full layers,
        the last ``min(P, W)`` with ``cumulative_length = P`` for sliding ones; the
        sliding layers then record every state the request adds."""
        dyn = _new_cache(self.model)
        slots = got.device_indices
        prefix = slots.numel()
        for layer in range(self.spec.layer_num):  # (tokens, heads, dim) -> (1, heads, tokens, dim)
            if not prefix:
                break
            pool, local, group = self._pool_layer(layer)
            idx = slots
            if group is not None and not group.attention.is_full:
                idx = got.groups[group.name][prefix - min(prefix, group.attention.window):]
            k = pool.buffer("k", local)[idx].permute(1, 0, 2).unsqueeze(0)
            v = pool.buffer("v", local)[idx].permute(1, 0, 2).unsqueeze(0)
            dyn.update(k, v, layer)
            if group is not None and not group.attention.is_full:
                dyn.layers[layer].cumulative_length = prefix  # positions and masks count every token seen
        if self.hybrid:
            dyn.activate_past_recording()
        return dyn

    def _from_dynamic(self, dyn, slots: torch.Tensor, groups: dict | None, start: int, stop: int) -> None:
        """Write tokens ``[start, stop)`` of every layer of ``dyn`` into their groups' slots
        (a sliding group's slot of ``-1``: that token is not kept)."""
        for layer, cached in enumerate(dyn.layers):
            pool, local, group = self._pool_layer(layer)
            dst, first = slots, 0
            if group is not None and not group.attention.is_full:
                dst, first = groups[group.name], cached.cumulative_length - cached.keys.shape[-2]
            span = slice(start - first, stop - first)
            keys, values = cached.keys[0, :, span], cached.values[0, :, span]
            keep = dst >= 0
            if not bool(keep.all()):
                dst, keys, values = dst[keep], keys[:, keep.to(keys.device)], values[:, keep.to(values.device)]
            pool.buffer("k", local)[dst] = keys.permute(1, 0, 2)
            pool.buffer("v", local)[dst] = values.permute(1, 0, 2)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, input_ids, max_new_tokens: int = 16, salt=None, eos_token_id: int | None = None
                 ) -> RequestStats:
        """Greedy decoding of ``max_new_tokens`` (or until ``eos_token_id``) after ``input_ids``,
        reusing every cached page of the prompt; the sequence's new full pages are cached after."""
        salt = self.salt if salt is None else salt
        tokens = token_array(input_ids).tolist()
        reusable = tokens[:-1]  # the last prompt token is always computed: its logits pick the next token
        cache = self.cache
        t0 = time.perf_counter()  # prefill time includes finding and bringing in the reused KV
        got = held = cache.acquire(reusable, salt)
        try:
            reused = got.device_indices.numel()
            dyn = self._to_dynamic(got)
            logits = _forward(self.model, torch.tensor([tokens[reused:]], device=self.model.device), dyn).logits
            prefill_s = time.perf_counter() - t0
            first_logits = logits[0, -1].detach().clone()
            output = _greedy(self.model, logits, dyn, max_new_tokens, eos_token_id)
            held = self._commit(got, tokens + output, dyn, len(tokens))
        finally:
            cache.release(held)
        return RequestStats(len(tokens), got.device_hit, got.host_hit, got.storage_hit, len(tokens) - reused,
                            prefill_s, output, first_logits)

    def hf_generate(self, input_ids, salt=None, **generate_kwargs):
        """``model.generate(input_ids, **generate_kwargs)`` with kvtier underneath: the
        prompt's cached prefix is restored into the ``DynamicCache`` passed as
        ``past_key_values`` (so the model runs only on the rest), and the sequence's
        full pages are cached afterwards. Sampling, ``GenerationConfig``, stop
        strings, streamers work as without kvtier; one sequence at a time (batch 1).
        Where the search keeps several rows (beams, several returned sequences), which
        row holds which output is the search's: only the prompt's pages, the same in
        every row, are cached. Returns what ``model.generate`` returns."""
        salt = self.salt if salt is None else salt
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor([list(input_ids)])
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise UsageError(f"hf_generate takes one sequence (batch 1), got input_ids of shape {tuple(ids.shape)}")
        if "past_key_values" in generate_kwargs or "cache" in generate_kwargs:
            raise UsageError("hf_generate brings its own past_key_values (the cached prefix); do not pass one")
        tokens = ids[0].tolist()
        got = held = self.cache.acquire(tokens[:-1], salt)  # the last prompt token is always computed
        try:
            dyn = self._to_dynamic(got)
            out = self.model.generate(ids.to(self.model.device), past_key_values=dyn, **generate_kwargs)
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            rows = dyn.layers[0].keys.shape[0] if dyn.layers and dyn.layers[0].keys is not None else 1
            held = self._commit(got, sequences[0].tolist() if rows == 1 else tokens, dyn, len(tokens))
        finally:
            self.cache.release(held)
        return out

    def _commit(self, got, sequence: list[int], dyn, prompt: int):
        """Cache the sequence's new full pages; returns the lease to release. The point
        where a repeat of the ``prompt``-token prompt resumes is kept resumable."""
        ps = self.cache.page_size
        # KV exists for sequence[:have] (not the last generated token; only the prompt's where
        # the sequence given is the prompt)
        have = min(dyn.get_seq_length(), len(sequence))
        full = have - have % ps
        start = got.device_indices.numel()
        if full <= start:
            return got
        slots = self.cache.alloc_device(full - start)
        if slots is None:  # the device is full of locked pages: cache the leading pages that fit
            room = self.cache.allocator.available_size() // ps * ps
            slots = self.cache.alloc_device(room) if room else None
            if slots is None:
                return got
            full = start + room
        groups = self._sliding_slots(full - start)
        self._from_dynamic(dyn, slots, groups, start, full)
        repeat = (prompt - 1) // ps * ps  # what acquire() of the same prompt reuses at most
        resume_at = (repeat,) if self.hybrid and start < repeat <= full else ()
        return self.cache.commit(got, sequence[:full], slots, groups=groups, resume_at=resume_at).acquired

    def _sliding_slots(self, n: int) -> dict | None:
        """Each sliding group's slots for ``n`` new tokens (``-1`` where its pool has no
        room: that group keeps nothing of them, so no hit will need them)."""
        if not self.hybrid:
            return None
        out = {}
        for group in self.spec.groups:
            if not group.attention.is_full:
                got = self.cache.alloc_device(n, group=group.name)
                out[group.name] = got if got is not None else torch.full((n,), -1, dtype=torch.int64)
        return out


def generate_uncached(model, input_ids, max_new_tokens: int = 16, eos_token_id: int | None = None
                      ) -> tuple[list[int], float]:
    """The same greedy loop without kvtier: the reference outputs and prefill time."""
    tokens = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    dyn = _new_cache(model)
    t0 = time.perf_counter()
    logits = _forward(model, torch.tensor([tokens], device=model.device), dyn).logits
    prefill_s = time.perf_counter() - t0
    return _greedy(model, logits, dyn, max_new_tokens, eos_token_id), prefill_s


def _greedy(model, logits, dyn, max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """Greedy decoding from the prefill's ``logits``, extending ``dyn`` token by token."""
    output = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        output.append(nxt)
        if nxt == eos_token_id or len(output) == max_new_tokens:
            break
        logits = _forward(model, torch.tensor([[nxt]], device=model.device), dyn).logits
    return output
