"""MLIR backend: TOSA / linalg modules per static subgraph, verified, and numerically
equal to the ONNX graphs when the linalg modules run on MLIR's execution engine."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHUNK, MAX_CONTEXT

torch_mlir = pytest.importorskip("torch_mlir", reason="torch-mlir is not installed (pip install 'llmc[mlir]')")


@pytest.fixture(scope="module")
def mlir_bundles(tmp_path_factory, model_dirs):
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("mlir")
    out = {}
    for dialect in ("tosa", "linalg"):
        out[dialect] = root / dialect
        compile_model(str(model_dirs("qwen2")), out[dialect], target="mlir", mlir_dialect=dialect, chunk=CHUNK, max_context=MAX_CONTEXT)
    return out


def test_modules_cover_every_subgraph_and_verify(mlir_bundles):
    from llmc.backends.mlir_backend import verify_text
    from llmc.runtime import load_manifest

    for dialect, d in mlir_bundles.items():
        m = load_manifest(d)
        assert set(m["mlir"]) == set(m["graphs"]) - {m["decode_graph"]}  # the decode graph (attention inside) is ONNX only
        for name, inst in m["mlir"].items():
            assert sorted(inst) == sorted(m["graphs"][name]["instances"])
            for rows, e in inst.items():
                text = (d / e["file"]).read_text()
                verify_text(text)
                assert f"func.func @{e['function']}" in text
                assert ("tosa." in text) == (dialect == "tosa")
                assert "dense_resource" not in text and "dense<\"0x" not in text  # weights stay out of the text
                assert e["args"][-len(m["graphs"][name]["weights"]):] == m["graphs"][name]["weights"]
                assert len(text) < 50_000


def test_linalg_modules_match_onnx(mlir_bundles):
    """Each linalg module, executed by MLIR's execution engine, equals the ONNX graph on the same inputs."""
    from llmc.backends.mlir_backend import execute_linalg
    from llmc.runtime import Session

    d = mlir_bundles["linalg"]
    s = Session(d)
    m = s.manifest
    rng = np.random.default_rng(0)
    for name, inst in m["mlir"].items():
        for rows, e in inst.items():
            g = m["graphs"][name]
            feeds = {i["name"]: rng.standard_normal((int(rows), i["features"])).astype(np.float32) for i in g["inputs"]}
            want = s._session(name, int(rows))[0].run([o["name"] for o in g["outputs"]], feeds)
            args = [feeds[a] if a in feeds else np.asarray(s._weights[a]) for a in e["args"]]
            got = execute_linalg((d / e["file"]).read_text(), e["function"], args)
            assert len(got) == len(want)
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"{name} r{rows}")


def test_mlir_bundle_still_runs(mlir_bundles, bundles):
    from llmc.runtime import Session

    ids = [5, 9, 17, 33, 40]
    assert Session(mlir_bundles["tosa"]).generate(ids, 6, stop_at_eos=False).token_ids == \
        Session(bundles("qwen2")).generate(ids, 6, stop_at_eos=False).token_ids


def test_lowering_failure_names_op_and_saves_reproducer(tmp_path):
    import torch

    from llmc.backends.mlir_backend import MlirBackendError, lower_module

    class Erfinv(torch.nn.Module):  # an op TOSA has no lowering for
        def forward(self, x):
            return torch.erfinv(x)

    with pytest.raises(MlirBackendError, match=r"torch\.aten\.erfinv.*torch-mlir-opt -pass-pipeline=.*blk\.torch\.mlir") as e:
        lower_module(Erfinv(), [torch.zeros(4, 8)], "blk", "tosa", tmp_path)
    assert "torch.aten.erfinv" in (tmp_path / "blk.torch.mlir").read_text()
    assert "subgraph blk" in str(e.value)


def test_missing_torch_mlir_is_explained(monkeypatch, model_dirs, tmp_path):
    import builtins

    from llmc.compile import compile_model
    from llmc.errors import LlmcError

    real = builtins.__import__

    def no_mlir(name, *a, **k):
        if name.startswith("torch_mlir"):
            raise ImportError("No module named 'torch_mlir'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mlir)
    with pytest.raises(LlmcError, match="needs torch-mlir") as e:
        compile_model(str(model_dirs("llama")), tmp_path / "o", target="mlir", chunk=CHUNK, max_context=MAX_CONTEXT)
    assert "llmc[mlir]" in e.value.hint
    assert not (tmp_path / "o").exists()
