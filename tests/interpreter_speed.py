"""Patch triton.language once per interpreted launch rather than once per device-function call.

The Triton interpreter (3.x) rebinds every builtin of `triton.language` when a launch starts
(`GridExecutor`), and again on every call of a nested `@triton.jit` function, each time walking
the module with `inspect.getmembers`. The nested rebinding changes nothing: the launch's bindings
stay in force until it ends, and builtins already rebound are no longer builtins, so the walk
finds nothing left to bind. Kernels that call a helper per tile pay that walk per call. This
skips it while a launch whose patch covers the helper's language modules is running; outside a
launch the interpreter runs unchanged.

Only tests import this; the kernels and what the interpreter computes are untouched.
"""

from __future__ import annotations

import inspect


def install() -> None:
    """Wrap the interpreter's patch step; changes nothing where this Triton lacks the hooks."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    real_patch = getattr(ti, "_patch_lang", None)
    executor = getattr(ti, "GridExecutor", None)
    scope_cls = getattr(ti, "_LangPatchScope", None)
    if real_patch is None or executor is None or scope_cls is None:
        return
    langs_of_interest = (ti.tl, ti.tl.core)
    patched: frozenset | None = None  # outside a launch; inside, the modules its patch rebound
    seen: dict = {}  # function -> ids of the language modules its globals hold

    def langs(fn) -> frozenset:
        if fn not in seen:
            values = fn.__globals__.values()
            seen[fn] = frozenset(
                id(v) for v in values if inspect.ismodule(v) and v in langs_of_interest
            )
        return seen[fn]

    def patch_once(fn):
        nonlocal patched
        if patched and langs(fn) <= patched:
            return scope_cls()  # nothing to restore: the launch's own scope restores it all
        scope = real_patch(fn)
        if patched is not None:
            patched |= langs(fn)
        return scope

    launch = executor.__call__

    def launch_patching_once(self, *args, **kwargs):
        nonlocal patched
        patched = frozenset()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = None

    ti._patch_lang = patch_once
    executor.__call__ = launch_patching_once
