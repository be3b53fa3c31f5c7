"""``"variant=B/16,sparsity=0.9,runlocal"`` -> typed config arguments (big_vision's parse_arg)."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """Parse ``key=value`` pairs (a bare ``key`` means True) against ``defaults``.

    Values take the type of their default; unknown keys raise ``ValueError`` naming the known ones.
    """
    out = ml_collections.ConfigDict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; known: {', '.join(defaults)}")
        default = defaults[key]
        if isinstance(default, bool):
            out[key] = value.lower() in ("", "1", "true", "yes")
        elif value == "":
            raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
        else:
            try:
                out[key] = type(default)(value)
            except ValueError:
                raise ValueError(
                    f"config argument {key}={value!r} is not a {type(default).__name__}"
                ) from None
    return out
