"""A fake sysfs for tests of what kvtier reads from it."""


def cache_dir(root, caches):
    """A sysfs ``cache`` folder under ``root`` holding ``(level, type, size)`` per ``index*``."""
    for i, (level, kind, size) in enumerate(caches):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(f"{text}\n")
    return str(root)
