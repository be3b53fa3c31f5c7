"""The JAX CUDA plugins installed for a Python interpreter, with the CUDA major version of each.

The CUDA build runs this with the interpreter CMake uses (cuda_plugin_guard.cmake) and refuses an
nvcc of another CUDA major version. Prints one line per plugin: "<distribution> <version> <major>";
nothing when none is installed (a CPU-only JAX). Arguments, if any, are the directories to search
instead of the interpreter's path.
"""

import importlib.metadata
import re
import sys

# jax-cuda12-plugin, jax_cuda13_pjrt, ...: the major version is part of the name.
_PLUGIN = re.compile(r"jax[-_.]cuda(\d+)[-_.](plugin|pjrt)", re.IGNORECASE)


def installed_plugins(path=None):
    """Sorted [(name, version, cuda_major)] of the JAX CUDA plugin distributions on `path`.

    `path`: directories to search (a list of str), or None for sys.path.
    """
    dists = importlib.metadata.distributions(**({} if path is None else {"path": path}))
    found = set()
    for dist in dists:
        name = dist.metadata["Name"] or ""
        if m := _PLUGIN.fullmatch(name):
            found.add((name, dist.version, int(m.group(1))))
    return sorted(found)


if __name__ == "__main__":
    for name, version, major in installed_plugins(sys.argv[1:] or None):
        print(name, version, major)
