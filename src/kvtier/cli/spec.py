"""Command-line spellings of a KVSpec: ``--mha layers=61,heads=8,head_dim=192,v_head_dim=128``."""

from __future__ import annotations

import argparse

from ..spec import Component, KVSpec, parse_dtype

_FIELDS = {
    "mha": ("layers", "heads", "head_dim", "v_head_dim"),
    "mla": ("layers", "kv_lora_rank", "qk_rope_head_dim"),
    "k_only": ("layers", "heads", "head_dim"),
}
_OPTIONAL = {"v_head_dim"}


# Published geometries (per model card / config.json), for --spec NAME.
PRESETS = {
    "llama3-8b": lambda dtype: KVSpec.mha(32, 8, 128, dtype=dtype),
    "llama3-70b": lambda dtype: KVSpec.mha(80, 8, 128, dtype=dtype),
    "qwen2-7b": lambda dtype: KVSpec.mha(28, 4, 128, dtype=dtype),
    "mimo-v2-flash": lambda dtype: KVSpec.mha(48, 4, 192, v_head_dim=128, dtype=dtype),
    "deepseek-v3": lambda dtype: KVSpec.mla(61, 512, 64, dtype=dtype),
}


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV geometry (one of)")
    g.add_argument("--spec", metavar="NAME|KIND:KEY=N,...",
                   help=f"a preset ({', '.join(PRESETS)}) or e.g. mha:layers=61,heads=8,head_dim=192,v_head_dim=128")
    g.add_argument("--mha", metavar="KEY=N,...", help="layers=,heads=,head_dim=[,v_head_dim=]")
    g.add_argument("--mla", metavar="KEY=N,...", help="layers=,kv_lora_rank=,qk_rope_head_dim=")
    g.add_argument("--k-only", metavar="KEY=N,...", help="layers=,heads=,head_dim=")
    g.add_argument("--components", metavar="L:NAME=HxD,...", help="free form, e.g. 2:k=2x8,v=2x4,idx=1x6")
    g.add_argument("--dtype", default="bf16", help="bf16, fp16, fp32, fp8e4m3, ... (default bf16)")


def _parse_kv(kind: str, text: str) -> dict[str, int]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _FIELDS[kind]:
            raise ValueError(f"--{kind.replace('_', '-')}: bad item {part!r}; keys are {', '.join(_FIELDS[kind])}")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--{kind.replace('_', '-')}: {key}={value!r} is not an integer") from None
    missing = [f for f in _FIELDS[kind] if f not in out and f not in _OPTIONAL]
    if missing:
        raise ValueError(f"--{kind.replace('_', '-')}: missing {', '.join(missing)}")
    return out


def _parse_components(text: str) -> tuple[int, list[Component]]:
    layers, sep, rest = text.partition(":")
    if not sep:
        raise ValueError(f"--components {text!r}: expected LAYERS:NAME=HEADSxDIM,...")
    comps = []
    for part in rest.split(","):
        name, _, geom = part.partition("=")
        heads, _, dim = geom.partition("x")
        try:
            comps.append(Component(name.strip(), int(heads), int(dim)))
        except ValueError as e:
            raise ValueError(f"--components item {part!r}: {e}") from None
    try:
        return int(layers), comps
    except ValueError:
        raise ValueError(f"--components {text!r}: layers {layers!r} is not an integer") from None


_OPTIONS = ("spec", "mha", "mla", "k_only", "components")


def has_spec(args: argparse.Namespace) -> bool:
    """Whether any geometry option was given."""
    return any(getattr(args, k, None) for k in _OPTIONS)


def spec_from_args(args: argparse.Namespace) -> KVSpec:
    """Build the KVSpec named by exactly one of the geometry options."""
    given = [k for k in _OPTIONS if getattr(args, k, None)]
    if len(given) != 1:
        raise ValueError("give exactly one of --spec, --mha, --mla, --k-only, --components")
    dtype = parse_dtype(args.dtype)
    kind, text = given[0], getattr(args, given[0])
    if kind == "spec":
        if text in PRESETS:
            return PRESETS[text](dtype)
        kind, sep, text = text.partition(":")
        kind = kind.replace("-", "_")
        if not sep or kind not in _FIELDS and kind != "components":
            raise ValueError(f"--spec {getattr(args, 'spec')!r}: use a preset ({', '.join(PRESETS)}) or "
                             "KIND:KEY=N,... with KIND mha, mla, k_only or components")
    if kind == "components":
        layers, comps = _parse_components(text)
        return KVSpec(layers, tuple(comps), dtype)
    f = _parse_kv(kind, text)
    if kind == "mha":
        return KVSpec.mha(f["layers"], f["heads"], f["head_dim"], f.get("v_head_dim"), dtype=dtype)
    if kind == "mla":
        return KVSpec.mla(f["layers"], f["kv_lora_rank"], f["qk_rope_head_dim"], dtype=dtype)
    return KVSpec.k_only(f["layers"], f["heads"], f["head_dim"], dtype=dtype)
