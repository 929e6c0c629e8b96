"""MLIR backend: each static subgraph as a TOSA or linalg-on-tensors module, through torch-mlir.

Same cut as the ONNX backend: one module per subgraph and row count (C for
prefill chunks, 1 for decode), written to ``mlir/<name>.r<rows>.<dialect>.mlir``.
Weights stay out of the text: every weight is a function argument after the
activations, in the order the manifest records, and the data is the bundle's
shared ``weights/weights.bin``.

The subgraph is rebuilt as a small torch module from the IR (weights passed as
arguments), imported with ``torch_mlir.fx.export_and_import`` into the torch
backend contract, then lowered with torch-mlir's backend pipeline. A lowering
failure names the subgraph and the ops MLIR rejected, writes a reproducer
(``<name>.torch.mlir``) into ``--repro-dir`` and says which ``torch-mlir-opt``
command reproduces it.

``execute_linalg`` lowers a linalg module to LLVM and runs it with MLIR's
execution engine; tests use it to check the modules numerically against the
ONNX graphs.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np

from llmc.analyses import ChunkPlan, Subgraph
from llmc.errors import LlmcError
from llmc.ir import Graph

log = logging.getLogger(__name__)

DIALECTS = {"tosa": "torch-backend-to-tosa-backend-pipeline", "linalg": "torch-backend-to-linalg-on-tensors-backend-pipeline"}


class MlirBackendError(LlmcError):
    exit_code = 8


def require_torch_mlir():
    try:
        import torch_mlir  # noqa: F401
        from torch_mlir import fx, ir  # noqa: F401
    except ImportError as e:
        raise MlirBackendError("--target mlir needs torch-mlir, which is not installed", hint="pip install 'llmc[mlir]' (or: pip install torch-mlir)") from e


def _torch_module(graph: Graph, sub: Subgraph):
    import torch
    import torch.nn.functional as F

    nodes = [graph.node(n) for n in sub.nodes]
    unsupported = sorted({n.op for n in nodes} - {"Linear", "RMSNorm", "LayerNorm", "Act", "Add", "Mul", "Scale", "Slice"})
    if unsupported:
        raise MlirBackendError(
            f"subgraph {sub.name}: the MLIR backend has no lowering for {', '.join(unsupported)}",
            hint="--target mlir emits the float32 pipeline; quantized ops are not lowered to MLIR yet",
        )
    n_in = len(sub.inputs)

    class Block(torch.nn.Module):
        def forward(self, *args):
            env = dict(zip(sub.inputs, args[:n_in]))
            w = dict(zip(sub.weights, args[n_in:]))
            for n in nodes:
                x = [env[v.name] for v in n.inputs]
                a = n.attrs
                if n.op == "Linear":
                    y = F.linear(x[0], w[n.weights["weight"].name], w[n.weights["bias"].name] if "bias" in n.weights else None)
                elif n.op == "RMSNorm":
                    scale = w[n.weights["weight"].name]
                    if a["offset"]:
                        scale = scale + a["offset"]
                    y = x[0] * torch.rsqrt(x[0].pow(2).mean(-1, keepdim=True) + a["eps"]) * scale
                elif n.op == "LayerNorm":
                    b = w[n.weights["bias"].name] if "bias" in n.weights else None
                    y = F.layer_norm(x[0], (x[0].shape[-1],), w[n.weights["weight"].name], b, a["eps"])
                elif n.op == "Act":
                    y = F.silu(x[0]) if a["kind"] == "silu" else F.gelu(x[0], approximate="tanh" if a["kind"] == "gelu_tanh" else "none")
                elif n.op == "Add":
                    y = x[0] + x[1]
                elif n.op == "Mul":
                    y = x[0] * x[1]
                elif n.op == "Scale":
                    y = x[0] * a["value"]
                else:  # Slice
                    y = x[0][:, a["start"] : a["end"]]
                env[n.outputs[0].name] = y
            return tuple(env[o] for o in sub.outputs)

    return Block()


def _example_args(graph: Graph, sub: Subgraph, rows: int):
    import torch

    vals = {v.name: v for n in (graph.node(x) for x in sub.nodes) for v in n.inputs}
    args = [torch.zeros((rows, vals[i].shape[1]), dtype=torch.float32) for i in sub.inputs]
    args += [torch.zeros(graph.weights[w].shape, dtype=torch.float32) for w in sub.weights]
    return args


def lower_module(module, args, func_name: str, dialect: str, repro_dir: Path | None) -> str:
    """torch module -> MLIR text in ``dialect``; on failure a reproducer and a clear error."""
    from torch_mlir import fx, ir
    from torch_mlir.passmanager import PassManager

    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.export internals, not actionable here
            torch_mod = fx.export_and_import(module, *args, output_type="torch", func_name=func_name)
    except Exception as e:  # torch-mlir's own error text carries its reproducer command
        raise MlirBackendError(f"importing subgraph {func_name} into torch-mlir failed: {str(e).strip()[:2000]}",
                               hint="the message above names the failing op and the torch-mlir-opt command that reproduces it") from e
    ctx = torch_mod.context
    repro_text = torch_mod.operation.get_asm(large_elements_limit=16)
    pipeline = f"builtin.module({DIALECTS[dialect]})"
    ctx.emit_error_diagnostics = False
    try:
        with ctx:
            PassManager.parse(pipeline).run(torch_mod.operation)
    except ir.MLIRError as e:
        diags = [d.message for d in e.error_diagnostics] or [str(e)]
        where = ""
        if repro_dir is not None:
            repro_dir.mkdir(parents=True, exist_ok=True)
            path = repro_dir / f"{func_name}.torch.mlir"
            path.write_text(repro_text)
            where = f"; reproducer saved: torch-mlir-opt -pass-pipeline='{pipeline}' {path}"
        raise MlirBackendError(
            f"lowering subgraph {func_name} to {dialect} failed: {'; '.join(diags)}{where}",
            hint="the failing op is named above; run the torch-mlir-opt command to iterate on the lowering",
        ) from None
    if not torch_mod.operation.verify():
        raise MlirBackendError(f"the {dialect} module of {func_name} does not verify")
    return torch_mod.operation.get_asm()


def verify_text(text: str) -> None:
    """Parse and verify MLIR text with MLIR's Python bindings (raises on failure)."""
    from torch_mlir import ir

    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = False
        module = ir.Module.parse(text)
        if not module.operation.verify():
            raise MlirBackendError("module does not verify")


def emit_mlir(graph: Graph, plan: ChunkPlan, root: Path, dialect: str, repro_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Write every subgraph instance as MLIR; return ``{subgraph: {rows: {file, dialect, function, args}}}``."""
    require_torch_mlir()
    if dialect not in DIALECTS:
        raise MlirBackendError(f"unknown MLIR dialect {dialect!r}", hint="choose one of: " + ", ".join(DIALECTS))
    (root / "mlir").mkdir(parents=True, exist_ok=True)
    table: dict[str, dict[str, Any]] = {}
    for sub in plan.subgraphs:
        module = _torch_module(graph, sub)
        table[sub.name] = {}
        for rows in sub.row_counts:
            func = f"{sub.name}_r{rows}"
            text = lower_module(module, _example_args(graph, sub, rows), func, dialect, repro_dir)
            verify_text(text)
            rel = f"mlir/{sub.name}.r{rows}.{dialect}.mlir"
            (root / rel).write_text(text)
            table[sub.name][str(rows)] = {"file": rel, "dialect": dialect, "function": func,
                                          "args": list(sub.inputs) + list(sub.weights), "results": list(sub.outputs)}
        log.info("mlir: %s (%s) written", sub.name, dialect)
    return table


# -- execution (numerical checks) ------------------------------------------------

# Lowering of linalg-on-tensors to the LLVM dialect for MLIR's execution engine:
# bufferize, lower linalg to loops, then everything to LLVM. The calling
# convention pass makes each function hand its results to a callback
# (refbackend_consume_func_return_<types>) that the engine resolves.
_LLVM_PIPELINE = ",".join([
    "func.func(linalg-generalize-named-ops)", "func.func(linalg-fuse-elementwise-ops)", "convert-shape-to-std",
    "func.func(refback-generalize-tensor-pad)", "func.func(refback-generalize-tensor-concat)", "func.func(tm-tensor-bufferize)",
    "one-shot-bufferize{copy-before-write bufferize-function-boundaries function-boundary-type-conversion=identity-layout-map}",
    "refback-mlprogram-bufferize", "buffer-deallocation-pipeline", "inline", "refback-munge-calling-conventions",
    "func.func(tm-tensor-to-loops)", "func.func(refback-munge-memref-copy)", "func.func(convert-linalg-to-loops)",
    "func.func(lower-affine)", "convert-scf-to-cf", "func.func(refback-expand-ops-for-llvm)", "func.func(arith-expand)",
    "func.func(convert-math-to-llvm)", "convert-math-to-libm", "expand-strided-metadata", "finalize-memref-to-llvm",
    "lower-affine", "convert-bufferization-to-memref", "finalize-memref-to-llvm", "func.func(convert-arith-to-llvm)",
    "convert-vector-to-llvm", "convert-func-to-llvm", "convert-cf-to-llvm", "convert-complex-to-llvm", "reconcile-unrealized-casts",
])
_RETURN_PREFIX = "refbackend_consume_func_return_"


def execute_linalg(text: str, function: str, args: list[np.ndarray]) -> list[np.ndarray]:
    """Lower a linalg-on-tensors module to LLVM, JIT it and call ``function`` on ``args``."""
    from torch_mlir import ir
    from torch_mlir.execution_engine import ExecutionEngine
    from torch_mlir.passmanager import PassManager
    from torch_mlir.runtime import UnrankedMemRefDescriptor, get_unranked_memref_descriptor, unranked_memref_to_numpy

    with ir.Context():
        module = ir.Module.parse(text)
        PassManager.parse(f"builtin.module({_LLVM_PIPELINE})").run(module.operation)
        engine = ExecutionEngine(module, opt_level=2)
        results: list[np.ndarray] = []
        keep = []
        for op in module.body:
            name = ir.StringAttr(op.attributes["sym_name"]).value
            if not name.startswith(_RETURN_PREFIX):
                continue
            kinds = name[len(_RETURN_PREFIX):].split("_")
            if any(k != "mrf32" for k in kinds):
                raise MlirBackendError(f"execute_linalg handles float32 results only, {function} returns {kinds}")
            proto = ctypes.CFUNCTYPE(None, *[ctypes.POINTER(UnrankedMemRefDescriptor)] * len(kinds))

            def consume(*ptrs):
                results[:] = [np.array(unranked_memref_to_numpy(p, np.float32)) for p in ptrs]

            cb = proto(consume)
            keep.append(cb)
            engine.register_runtime(name, cb)
        arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in args]
        engine.invoke(function, *[ctypes.pointer(ctypes.pointer(get_unranked_memref_descriptor(a))) for a in arrays])
        return list(results)
