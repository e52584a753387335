"""A benchmark run with one of the kernels' module-level settings changed: the A/B of a constant
or a config field in one device call, each side a run of the same script.

    PYTHONPATH=.:bench python bench/setting.py NAME=VALUE [NAME=VALUE ...] -- SCRIPT [ARGS ...]

NAME is a module of moelora.kernels and an attribute of it, dotted
(moelora.kernels.attention.mla_absorb.FILL=1), or one field of a frozen dataclass held in
such an attribute (moelora.kernels.linear_attention.delta_chunked.CONFIG.num_stages=1, set
with dataclasses.replace). VALUE is read as a Python literal (1, 2.5, True, "tf32"). The
settings are made before SCRIPT runs, as its __main__, with ARGS as its arguments; a kernel
launch reads them where the engine would (a name bound at import elsewhere keeps the old value:
set the module that reads it).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import runpy
import sys

ALLOWED = "moelora.kernels."  # the kernels' modules only (tests/test_bench_imports.py)


def _target(dotted: str) -> tuple[object, list[str]]:
    """(the module, the attribute path inside it) of a dotted NAME."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 2, -1):
        name = ".".join(parts[:cut])
        try:
            return importlib.import_module(name), parts[cut:]
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"{dotted!r}: no module of moelora.kernels in it")


def apply(setting: str) -> str:
    """Make one NAME=VALUE setting; returns what it set, for the log."""
    dotted, sep, text = setting.partition("=")
    if not sep or not dotted.startswith(ALLOWED):
        raise SystemExit(f"{setting!r}: expected NAME=VALUE, NAME in {ALLOWED}*")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise SystemExit(f"{setting!r}: VALUE must be a Python literal") from None
    module, path = _target(dotted)
    if len(path) == 1:
        if not hasattr(module, path[0]):
            raise SystemExit(f"{setting!r}: {module.__name__} has no {path[0]}")
        setattr(module, path[0], value)
    elif len(path) == 2:
        held = getattr(module, path[0])
        if not dataclasses.is_dataclass(held) or path[1] not in held.__dataclass_fields__:
            raise SystemExit(f"{setting!r}: {path[0]} has no dataclass field {path[1]}")
        setattr(module, path[0], dataclasses.replace(held, **{path[1]: value}))
    else:
        raise SystemExit(f"{setting!r}: a module attribute or one field of it")
    return f"{module.__name__}.{'.'.join(path)} = {value!r}"


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    for setting in argv[:cut]:
        print(f"setting: {apply(setting)}", flush=True)
    sys.argv = argv[cut + 1 :]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
