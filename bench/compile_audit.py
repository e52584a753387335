"""Every launch the engine's kernels make, compiled for sm_90 on this machine (no GPU needed):
registers, spilled bytes, shared memory, and the global loads by width, worst first.

A diagnostic: a kernel that spills, or loads a tensor one 16-bit element at a time where its
rows are contiguous, is worth a look on the device. The launches are tests/kernels/
test_sm90_compile.py's (the engine's ops at a Qwen3-30B-A3B layer's sizes, LoRA on and off,
the H200 MoE table's tiles, the FP8 projections), specialized as the H200's JIT would; ptxas
-v says what each costs. Writes its dated result file.

    PYTHONPATH=. python bench/compile_audit.py [--kernels REGEX] [--out PATH]

--kernels: only the launches of kernels whose names match REGEX (a few minutes less).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from common import result_header, write_result

# the CPU suite's sm_90 compile and its recorded launches (tests/kernels/test_sm90_compile.py)
sys.path[:0] = [str(Path(__file__).parents[1] / "tests" / p) for p in ("kernels", "")]
from test_sm90_compile import arg_type, compile_sm90, launch_every_op, record_launches  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
LOAD = re.compile(r"ld\.global(?:\.[a-z]+)*\.(v\d\.)?([bfsu]\d+)")


def audit(kernel, args, kwargs) -> dict:
    """One launch compiled: registers, spill bytes, shared bytes, load counts."""
    compiled = compile_sm90(kernel, args, dict(kwargs))
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [str(PTXAS), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(src) + ".cubin"]
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    loads = Counter(LOAD.findall(ptx))
    return dict(
        kernel=kernel.fn.__name__,
        regs=int(re.search(r"Used (\d+) registers", info).group(1)),
        spill=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
        shared=compiled.metadata.shared,
        scalar16=sum(n for (vec, t), n in loads.items() if not vec and t.endswith("16")),
        vector=sum(n for (vec, _), n in loads.items() if vec),
        cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
        meta={k: v for k, v in kwargs.items() if k.isupper() and k != "PDL"},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="only kernels whose names match this regex")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    wanted = re.compile(args.kernels or "")
    launches = record_launches()
    launch_every_op()
    seen, rows = set(), []
    for kernel, largs, kwargs in launches:
        if not wanted.search(kernel.fn.__name__):
            continue
        key = (kernel.fn.__name__, repr([arg_type(a) for a in largs]), repr(sorted(kwargs.items())))
        if key not in seen:
            seen.add(key)
            rows.append(audit(kernel, largs, kwargs))
    rows.sort(key=lambda r: (-r["spill"], -r["scalar16"], r["kernel"]))
    lines = result_header("Kernel launches compiled for sm_90 (ptxas -v)", None, device="cpu")
    lines += [
        f"- {len(rows)} distinct launches (tests/kernels/test_sm90_compile.launch_every_op"
        + (f", kernels matching {args.kernels!r})" if args.kernels else ")"),
        "- loads: PTX ld.global instructions, 16-bit scalar and vector; cp.async: copies into",
        "  shared memory (pipelined loads)",
        "",
        "| kernel | regs | spill B | shared B | ld 16-bit | ld vector | cp.async | meta |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        cells = (r["regs"], r["spill"], r["shared"], r["scalar16"], r["vector"], r["cp_async"])
        lines.append(f"| {r['kernel']} | {' | '.join(map(str, cells))} | {r['meta']} |")
    print("\n".join(lines[-len(rows) - 2 :][:40]))
    write_result("compile-audit", lines, args.out)


if __name__ == "__main__":
    main()
