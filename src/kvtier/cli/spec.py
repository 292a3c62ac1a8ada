"""Command-line spellings of a KV geometry: ``--mha layers=61,heads=8,head_dim=192,v_head_dim=128``,
``--spec NAME`` (a preset), ``--spec hybrid:...`` (sliding-window and full-attention layer groups).

:func:`spec_from_args` gives a :class:`~kvtier.spec.KVSpec` for one geometry, or a
:class:`~kvtier.hybrid.HybridSpec` when layers differ in attention or geometry.
"""

from __future__ import annotations

import argparse

from .. import hybrid
from ..errors import UsageError
from ..hybrid import Attention, HybridSpec, KVGroup, layer_ranges
from ..spec import Component, KVSpec, parse_dtype

_FIELDS = {
    "mha": ("layers", "heads", "head_dim", "v_head_dim"),
    "mla": ("layers", "kv_lora_rank", "qk_rope_head_dim"),
    "k_only": ("layers", "heads", "head_dim"),
}
_OPTIONAL = {"v_head_dim"}


# Published geometries (per model card / config.json), for --spec NAME: each takes the dtype.
_UNIFORM_PRESETS = {
    "llama3-8b": lambda dtype: KVSpec.mha(32, 8, 128, dtype=dtype),
    "llama3-70b": lambda dtype: KVSpec.mha(80, 8, 128, dtype=dtype),
    "qwen2-7b": lambda dtype: KVSpec.mha(28, 4, 128, dtype=dtype),
    "deepseek-v3": lambda dtype: KVSpec.mla(61, 512, 64, dtype=dtype),
}
PRESETS = {**_UNIFORM_PRESETS, **hybrid.PRESETS}

# -- the hybrid: spelling -----------------------------------------------------------------------------
#: Group names of a ``hybrid:`` spelling, in the order the spec lists them (as kvtier.hybrid's presets).
_GROUPS = {"full": "F", "swa": "S"}
_LAYER_KEYS = ("layers", "full", "swa", "pattern")
_GROUP_KEYS = {"full": ("heads", "head_dim", "v_head_dim"), "swa": ("window", "heads", "head_dim", "v_head_dim")}
_HYBRID = "--spec hybrid"
_HYBRID_FORM = ("hybrid:layers=N,{full=IDS|swa=IDS|pattern=F/S letters};full:heads=H,head_dim=D[,v_head_dim=V];"
                "swa:window=W,heads=H,head_dim=D[,v_head_dim=V]")
_HYBRID_HELP = (
    "Hybrid models (sliding-window and full-attention layers): --spec " + _HYBRID_FORM + ". "
    "The first part gives the layer count and which layers are full: full=IDS (the rest slide) or swa=IDS (the "
    "rest are full), IDS being ids and ranges joined by '/' (0/5/11-13); or pattern=LETTERS, F full and S "
    "sliding, repeated from layer 0 (gpt-oss: SF, Gemma 3: SSSSSF). Then one part per kind of layer present: "
    "full: and swa: with KV heads, K head_dim and V v_head_dim (default head_dim); swa: also takes the window W "
    "(past tokens a query sees). MiMo-V2-Flash: hybrid:layers=48,full=0/5/11/17/23/29/35/41/47;"
    "full:heads=4,head_dim=192,v_head_dim=128;swa:window=128,heads=8,head_dim=192,v_head_dim=128. "
    "--dtype applies to every group.")


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV geometry (one of)", _HYBRID_HELP)
    g.add_argument("--spec", metavar="NAME|KIND:KEY=N,...",
                   help=f"a preset ({', '.join(_UNIFORM_PRESETS)}; hybrid: {', '.join(hybrid.PRESETS)}), "
                        "KIND:KEY=N,... with KIND mha, mla, k-only or components "
                        "(e.g. mha:layers=61,heads=8,head_dim=192,v_head_dim=128), or hybrid:... (above)")
    g.add_argument("--mha", metavar="KEY=N,...", help="layers=,heads=,head_dim=[,v_head_dim=]")
    g.add_argument("--mla", metavar="KEY=N,...", help="layers=,kv_lora_rank=,qk_rope_head_dim=")
    g.add_argument("--k-only", metavar="KEY=N,...", help="layers=,heads=,head_dim=")
    g.add_argument("--components", metavar="L:NAME=HxD,...", help="free form, e.g. 2:k=2x8,v=2x4,idx=1x6")
    g.add_argument("--dtype", default="bf16", help="bf16, fp16, fp32, fp8e4m3, ... (default bf16)")


def _items(what: str, text: str, keys: tuple[str, ...]) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``, each key among ``keys`` and given once."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise UsageError(f"{what}: bad item {part!r}; keys are {', '.join(keys)}")
        if key in out:
            raise UsageError(f"{what}: {key}= given twice")
        out[key] = value.strip()
    return out


def _ints(what: str, items: dict[str, str], required: tuple[str, ...]) -> dict[str, int]:
    out = {}
    for key, value in items.items():
        try:
            out[key] = int(value)
        except ValueError:
            raise UsageError(f"{what}: {key}={value!r} is not an integer") from None
        if key == "layers":
            _check_layers(what, out[key])
    missing = [k for k in required if k not in out]
    if missing:
        raise UsageError(f"{what}: missing {', '.join(missing)}")
    return out


def _parse_kv(kind: str, text: str) -> dict[str, int]:
    what = f"--{kind.replace('_', '-')}"
    return _ints(what, _items(what, text, _FIELDS[kind]), tuple(f for f in _FIELDS[kind] if f not in _OPTIONAL))


def _parse_components(text: str) -> tuple[int, list[Component]]:
    layers, sep, rest = text.partition(":")
    if not sep:
        raise UsageError(f"--components {text!r}: expected LAYERS:NAME=HEADSxDIM,...")
    comps = []
    for part in rest.split(","):
        name, _, geom = part.partition("=")
        heads, _, dim = geom.partition("x")
        try:
            comps.append(Component(name.strip(), int(heads), int(dim)))
        except ValueError as e:
            raise UsageError(f"--components item {part!r}: {e}") from None
    try:
        count = int(layers)
    except ValueError:
        raise UsageError(f"--components {text!r}: layers {layers!r} is not an integer") from None
    _check_layers("--components", count)
    return count, comps


#: More layers than any model has; a count past it is a typo, refused before anything is built per layer
MAX_LAYERS = 1 << 16


def _check_layers(what: str, layers: int) -> None:
    if layers > MAX_LAYERS:
        raise UsageError(f"{what}: layers={layers} is more than {MAX_LAYERS:,}; no model has that many")


def _layer_ids(key: str, text: str, layers: int) -> set[int]:
    """``"0/5/11-13"`` -> ``{0, 5, 11, 12, 13}``, each id in ``[0, layers)`` and named once."""
    ids: list[int] = []
    for item in text.split("/"):
        lo, dash, hi = item.strip().partition("-")
        try:
            first = int(lo)
            last = int(hi) if dash else first
        except ValueError:
            raise UsageError(f"{_HYBRID}: {key}={text}: {item!r} is not a layer id or a range A-B") from None
        if first > last:
            raise UsageError(f"{_HYBRID}: {key}={text}: range {item!r} runs backwards")
        if last >= layers:
            raise UsageError(f"{_HYBRID}: {key}={text}: layer {last} is out of range [0, {layers})")
        ids.extend(range(first, last + 1))
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise UsageError(f"{_HYBRID}: {key}={text}: layers {layer_ranges(twice)} named twice")
    return set(ids)


def _layer_kinds(text: str) -> list[str]:
    """The first part of a ``hybrid:`` spelling: each layer's group name, ``full`` or ``swa``."""
    items = _items(f"{_HYBRID}: the layer part {text!r}", text, _LAYER_KEYS)
    if "layers" not in items:
        raise UsageError(f"{_HYBRID}: the first part {text!r} needs layers=N; the form is {_HYBRID_FORM}")
    layers = _ints(_HYBRID, {"layers": items["layers"]}, ("layers",))["layers"]
    if layers <= 0:
        raise UsageError(f"{_HYBRID}: layers={layers} must be a positive integer")
    rules = [k for k in ("full", "swa", "pattern") if k in items]
    if len(rules) != 1:
        raise UsageError(f"{_HYBRID}: the first part {text!r} needs exactly one of full=IDS, swa=IDS, pattern=LETTERS"
                         f" (got {len(rules)})")
    rule, value = rules[0], items[rules[0]]
    if rule == "pattern":
        letters = {v: k for k, v in _GROUPS.items()}
        bad = sorted({c for c in value.upper() if c not in letters})
        if bad or not value:
            raise UsageError(f"{_HYBRID}: pattern={value!r}: use letters F (full) and S (sliding), got "
                             f"{', '.join(map(repr, bad)) or 'none'}")
        return [letters[value.upper()[i % len(value)]] for i in range(layers)]
    named, other = rule, "swa" if rule == "full" else "full"
    ids = _layer_ids(rule, value, layers)
    return [named if i in ids else other for i in range(layers)]


def parse_hybrid(text: str, dtype) -> HybridSpec:
    """The spec of ``hybrid:TEXT`` (see :data:`_HYBRID_FORM`), every group in ``dtype``: a
    ``full`` group then a ``swa`` group, each present when some layer has its kind.
    ``UsageError`` names the offending part or item."""
    first, *parts = text.split(";")
    kinds = _layer_kinds(first)
    geometry: dict[str, dict[str, int]] = {}
    for part in parts:
        name, sep, items = part.partition(":")
        name = name.strip()
        if not sep or name not in _GROUP_KEYS:
            raise UsageError(f"{_HYBRID}: part {part!r}: expected full:KEY=N,... or swa:KEY=N,...")
        if name in geometry:
            raise UsageError(f"{_HYBRID}: two {name}: parts")
        what = f"{_HYBRID}: the {name}: part"
        required = tuple(k for k in _GROUP_KEYS[name] if k not in _OPTIONAL)
        geometry[name] = _ints(what, _items(what, items, _GROUP_KEYS[name]), required)
    groups = []
    for name in _GROUPS:
        layers = tuple(i for i, kind in enumerate(kinds) if kind == name)
        if layers and name not in geometry:
            raise UsageError(f"{_HYBRID}: layers {layer_ranges(layers)} are {name} but there is no {name}: part "
                             f"(e.g. {name}:{'window=128,' if name == 'swa' else ''}heads=8,head_dim=128)")
        if name in geometry and not layers:
            raise UsageError(f"{_HYBRID}: a {name}: part, but no layer is {name}")
        if not layers:
            continue
        f = geometry[name]
        try:
            spec = KVSpec.mha(len(layers), f["heads"], f["head_dim"], f.get("v_head_dim"), dtype=dtype)
            attention = Attention.sliding(f["window"]) if name == "swa" else Attention()
            groups.append(KVGroup(name, layers, spec, attention))
        except ValueError as e:
            raise UsageError(f"{_HYBRID}: {name}: {e}") from None
    return HybridSpec(tuple(groups))


# -- one geometry from the options ---------------------------------------------------------------------
_OPTIONS = ("spec", "mha", "mla", "k_only", "components")


def has_spec(args: argparse.Namespace) -> bool:
    """Whether any geometry option was given."""
    return any(getattr(args, k, None) for k in _OPTIONS)


def spec_from_args(args: argparse.Namespace) -> KVSpec | HybridSpec:
    """The geometry named by exactly one of the geometry options: a ``KVSpec``, or a
    ``HybridSpec`` for a hybrid preset or spelling (one whose layers are all full
    attention of one geometry is its plain ``KVSpec``)."""
    given = [k for k in _OPTIONS if getattr(args, k, None)]
    if len(given) != 1:
        raise UsageError("give exactly one of --spec, --mha, --mla, --k-only, --components")
    dtype = parse_dtype(args.dtype)
    kind, text = given[0], getattr(args, given[0])
    if kind == "spec":
        if text in PRESETS:
            return PRESETS[text](dtype)
        kind, sep, text = text.partition(":")
        kind = kind.replace("-", "_")
        if kind == "hybrid" and sep:
            spec = parse_hybrid(text, dtype)
            return spec.uniform_spec if spec.is_uniform else spec
        if not sep or kind not in _FIELDS and kind != "components":
            raise UsageError(f"--spec {getattr(args, 'spec')!r}: use a preset ({', '.join(PRESETS)}) or "
                             "KIND:KEY=N,... with KIND mha, mla, k_only, components or hybrid")
    if kind == "components":
        layers, comps = _parse_components(text)
        return KVSpec(layers, tuple(comps), dtype)
    f = _parse_kv(kind, text)
    if kind == "mha":
        return KVSpec.mha(f["layers"], f["heads"], f["head_dim"], f.get("v_head_dim"), dtype=dtype)
    if kind == "mla":
        return KVSpec.mla(f["layers"], f["kv_lora_rank"], f["qk_rope_head_dim"], dtype=dtype)
    return KVSpec.k_only(f["layers"], f["heads"], f["head_dim"], dtype=dtype)


def uniform_spec_from_args(args: argparse.Namespace, command: str) -> KVSpec:
    """:func:`spec_from_args` for a command that takes one geometry: a hybrid spec is
    refused with a ``UsageError`` naming its groups."""
    spec = spec_from_args(args)
    if isinstance(spec, HybridSpec):
        raise UsageError(f"{command} takes one geometry; {describe_groups(spec)}; give one group's geometry with "
                         "--mha, --mla, --k-only or --components")
    return spec


# -- what a spec costs, for reports --------------------------------------------------------------------
def as_hybrid(spec: KVSpec | HybridSpec) -> HybridSpec:
    return spec if isinstance(spec, HybridSpec) else HybridSpec.of(spec)


def attention_text(attention: Attention) -> str:
    return "full" if attention.is_full else f"sliding {attention.window}"


def describe_groups(spec: HybridSpec) -> str:
    """``this spec is hybrid: full (full, layers 0,5,...: L9-bf16-...), swa (sliding 128, ...)``."""
    groups = ", ".join(f"{g.name} ({attention_text(g.attention)}, layers {layer_ranges(g.layers)}: "
                       f"{g.spec.fingerprint()})" for g in spec.groups)
    return f"this spec is hybrid: {groups}"


def bytes_fields(spec: KVSpec | HybridSpec) -> dict:
    """A spec's bytes for a JSON report: ``spec`` (fingerprint), ``bytes_per_token`` (one
    token in every group, as a window-blind cache stores it; a plain spec's own figure),
    ``group_bytes_per_token`` ({group: bytes}; ``{"kv": ...}`` for a plain spec) and
    ``window_bytes`` (the sliding groups' KV per resume point; 0 without one)."""
    h = as_hybrid(spec)
    return {"spec": spec.fingerprint(), "bytes_per_token": h.uniform_bytes_per_token,
            "group_bytes_per_token": h.bytes_per_token(), "window_bytes": h.window_bytes}


def bytes_line(spec: KVSpec | HybridSpec) -> str:
    """One line of a spec's bytes: ``spec L32-...: 131,072 B per token`` or, for a hybrid
    spec, each group's bytes per token and its window's bytes per resume point."""
    if isinstance(spec, KVSpec):
        return f"spec {spec.fingerprint()}: {spec.bytes_per_token:,} B per token"
    parts = []
    for g in spec.groups:
        text = f"{g.name} {g.bytes_per_token:,} B per token ({attention_text(g.attention)}, {len(g.layers)} layers"
        if not g.attention.is_full:
            text += f"; {g.attention.window * g.bytes_per_token:,} B per resume point"
        parts.append(text + ")")
    return f"spec {spec.fingerprint()}: " + ", ".join(parts)
