"""Prefix reuse for Hugging Face transformers decoder-only models, across requests.

Before a request, the prompt is matched in a :class:`kvtier.HierarchicalCache`; the
hit (from device, host or storage) is copied into a ``DynamicCache`` and the model
runs only on the missing tokens; afterwards the new full pages go back into the
cache. Works for any model whose cache layers hold per-layer ``keys``/``values``
tensors ``(batch, heads, seq, dim)`` — the KVSpec is read off those tensors, so K
and V may differ in heads and dims (MiMo-V2-Flash K 192 / V 128; DeepSeek-V3,
whose cache holds its MLA latent and rope key as two one-head tensors).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from ..cache import HierarchicalCache
from ..cache.tokens import token_array
from ..pools import DeviceKVPool, HostKVPool
from ..spec import Component, KVSpec
from .identity import model_namespace, weights_digest


class UnsupportedModelError(ValueError):
    """The model's cache cannot be mapped to pages (e.g. sliding-window layers)."""


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _forward(model, input_ids: torch.Tensor, cache):
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=True, **{_cache_kwarg(model): cache})


def spec_from_model(model) -> KVSpec:
    """The KV geometry of ``model``, read off the cache tensors of a one-token forward."""
    cache = _new_cache(model)
    _forward(model, torch.zeros(1, 1, dtype=torch.long, device=model.device), cache)
    layers = getattr(cache, "layers", None)
    if not layers:
        raise UnsupportedModelError(f"{type(cache).__name__} exposes no per-layer keys/values")
    kinds = {type(layer).__name__ for layer in layers}
    if kinds != {"DynamicLayer"}:
        raise UnsupportedModelError(
            f"cache layers {sorted(kinds)} are not all full attention; configure full-attention layers "
            "(e.g. layer_types=['full_attention'] * num_hidden_layers)")
    k, v = layers[0].keys, layers[0].values
    for i, layer in enumerate(layers):
        if layer.keys.shape[1:] != k.shape[1:] or layer.values.shape[1:] != v.shape[1:]:
            raise UnsupportedModelError(f"layer {i} caches other shapes than layer 0")
    return KVSpec(len(layers), (Component("k", k.shape[1], k.shape[-1]), Component("v", v.shape[1], v.shape[-1])),
                  k.dtype)


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

    def __init__(self, model, cache: HierarchicalCache) -> None:
        self.model, self.cache = model, cache
        self.spec = cache.device_pool.spec

    @classmethod
    def build(cls, model, *, device_tokens: int, host_tokens: int, page_size: int = 16, storage=None,
              layout: str = "page_first", write_policy: str = "write_through", namespace: str | None = None,
              salt=None) -> "CachedGenerator":
        spec = spec_from_model(model)
        device = DeviceKVPool(spec, device_tokens, page_size, device=model.device)
        host = HostKVPool(spec, host_tokens, page_size, layout=layout)
        if namespace is None:
            namespace = hf_namespace(model) if storage is not None else None
        cache = HierarchicalCache(device, host, storage, write_policy=write_policy, prefetch_policy="wait_complete",
                                  namespace=namespace)
        return cls(model, cache)

    # -- DynamicCache <-> pool ------------------------------------------------------------------
    def _to_dynamic(self, slots: torch.Tensor):
        dyn = _new_cache(self.model)
        dev = self.cache.device_pool
        for layer in range(self.spec.layer_num):  # (tokens, heads, dim) -> (1, heads, tokens, dim)
            k = dev.buffer("k", layer)[slots].permute(1, 0, 2).unsqueeze(0)
            v = dev.buffer("v", layer)[slots].permute(1, 0, 2).unsqueeze(0)
            dyn.update(k, v, layer)
        return dyn

    def _from_dynamic(self, dyn, slots: torch.Tensor, start: int, stop: int) -> None:
        dev = self.cache.device_pool
        for layer, cached in enumerate(dyn.layers):
            dev.buffer("k", layer)[slots] = cached.keys[0, :, start:stop].permute(1, 0, 2)
            dev.buffer("v", layer)[slots] = cached.values[0, :, start:stop].permute(1, 0, 2)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, input_ids, max_new_tokens: int = 16, salt=None, eos_token_id: int | None = None
                 ) -> RequestStats:
        """Greedy decoding of ``max_new_tokens`` (or until ``eos_token_id``) after ``input_ids``,
        reusing every cached page of the prompt; the sequence's new full pages are cached after."""
        tokens = token_array(input_ids).tolist()
        reusable = tokens[:-1]  # the last prompt token is always computed: its logits pick the next token
        cache = self.cache
        t0 = time.perf_counter()  # prefill time includes finding and bringing in the reused KV
        got = held = cache.acquire(reusable, salt)
        try:
            reused = got.device_indices.numel()
            dyn = self._to_dynamic(got.device_indices)
            logits = _forward(self.model, torch.tensor([tokens[reused:]], device=self.model.device), dyn).logits
            prefill_s = time.perf_counter() - t0
            first_logits = logits[0, -1].detach().clone()
            output = _greedy(self.model, logits, dyn, max_new_tokens, eos_token_id)
            held = self._commit(got, tokens + output, dyn)
        finally:
            cache.release(held)
        return RequestStats(len(tokens), got.device_hit, got.host_hit, got.storage_hit, len(tokens) - reused,
                            prefill_s, output, first_logits)

    def _commit(self, got, sequence: list[int], dyn):
        """Cache the sequence's new full pages; returns the lease to release."""
        ps = self.cache.page_size
        have = dyn.get_seq_length()  # KV exists for sequence[:have] (not the last generated token)
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
        self._from_dynamic(dyn, slots, start, full)
        return self.cache.commit(got, sequence[:full], slots).acquired


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
