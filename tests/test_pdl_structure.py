"""Every kernel that takes a dependent launch (wideep_kernels/pdl.py) waits before it touches memory.

A kernel launched with `launch_pdl` may start before the kernel ahead of it has finished, so a
load or store placed before its wait races with that kernel. This reads the kernels' source: in
each function with a `PDL` argument, the wait must come first. The one exception, named below,
reads only weights before it (wideep_kernels/gemv.py says why that is safe)."""
import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "wideep_kernels"
READS_WEIGHTS_FIRST = {"_gemv_kernel", "_head_gemv_kernel", "_norm_gemv_kernel", "_norm_gate_parts_kernel"}


def _body_without_docstring(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _is_wait(stmt: ast.stmt) -> bool:
    src = ast.unparse(stmt)
    return src == "pdl_enter(PDL)" or src.startswith("if PDL >= 1:\n    gdc_wait()")


def _pdl_kernels():
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.FunctionDef) and node.name != "pdl_enter"  # the wait itself
                    and any(a.arg == "PDL" for a in node.args.args)):
                yield path.name, node


def test_every_dependent_launch_waits_first():
    found = list(_pdl_kernels())
    names = {fn.name for _, fn in found}
    # the decode step's kernels are all here
    assert {"_rms_norm_kernel", "_gate_up_kernel", "_down_kernel", "_select_kernel", "_score_tile_kernel",
            "_gluon_split_kernel", "_merge_kernel", "_route_kernel", "_latent_kernel", "_gemv_kernel", "_head_gemv_kernel",
            "_norm_gemv_kernel", "_norm_gate_parts_kernel"} <= names
    for file, fn in found:
        body = _body_without_docstring(fn)
        if fn.name in READS_WEIGHTS_FIRST:
            waits = [i for i, s in enumerate(body) if _is_wait(s)]
            assert waits, f"{file}:{fn.name} never waits"
            before = "\n".join(ast.unparse(s) for s in body[:waits[0]])
            assert "tl.store" not in before and "x_ptr" not in before, \
                f"{file}:{fn.name} touches more than weights first"
        else:
            assert body and _is_wait(body[0]), f"{file}:{fn.name} does something before its dependent-launch wait"


def test_the_gluon_kernel_also_releases_the_next_early():
    """pdl_enter does both for Triton kernels; the Gluon kernel spells them out."""
    (fn,) = [fn for _, fn in _pdl_kernels() if fn.name == "_gluon_split_kernel"]
    src = ast.unparse(fn)
    assert "if PDL >= 2:\n        gdc_launch_dependents()" in src
