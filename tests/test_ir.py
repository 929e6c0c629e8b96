"""The IR keeps def-use lists right and verify() names what is wrong."""

from __future__ import annotations

import pytest

from llmc.errors import IRVerificationError
from llmc.ir import Graph


def small_graph():
    g = Graph("t")
    w = g.weights.add("w", (6, 4), "float32", lambda: None)
    nw = g.weights.add("nw", (4,), "float32", lambda: None)
    x = g.add_input("x", (3, 4), "float32")
    norm = g.add_node("RMSNorm", [x], attrs={"eps": 1e-6, "offset": 0.0}, weights={"weight": nw})
    lin = g.add_node("Linear", [norm.outputs[0]], weights={"weight": w})
    g.set_outputs(lin.outputs)
    return g, x, norm, lin


def test_build_and_verify():
    g, x, norm, lin = small_graph()
    g.verify()
    assert lin.outputs[0].shape == (3, 6)
    assert norm.outputs[0].uses == ((lin, 0),)
    assert x.uses == ((norm, 0),)


def test_set_input_keeps_use_lists():
    g, x, norm, lin = small_graph()
    g.set_input(lin, 0, x)
    assert norm.outputs[0].uses == ()
    assert (lin, 0) in x.uses
    g.verify()
    g.remove_node(norm)
    g.verify()
    assert norm not in g.nodes


def test_remove_used_node_is_refused():
    g, x, norm, lin = small_graph()
    with pytest.raises(IRVerificationError, match="still used by"):
        g.remove_node(norm)


def test_verify_catches_shape_mismatch():
    g, x, norm, lin = small_graph()
    lin.outputs[0].shape = (3, 5)
    with pytest.raises(IRVerificationError, match="Linear"):
        g.verify()


def test_verify_catches_bad_order():
    g, x, norm, lin = small_graph()
    g._nodes.reverse()  # simulate a pass that broke topological order
    with pytest.raises(IRVerificationError, match="used before it is defined"):
        g.verify()


def test_verify_catches_missing_weight():
    g, x, norm, lin = small_graph()
    lin.weights["weight"] = type(lin.weights["weight"])("nope", (6, 4))
    with pytest.raises(IRVerificationError, match="not in the weight store"):
        g.verify()


def test_schema_rejects_wrong_features():
    g = Graph("t")
    w = g.weights.add("w", (6, 5), "float32", lambda: None)
    x = g.add_input("x", (3, 4), "float32")
    with pytest.raises(ValueError, match="weight expects 5"):
        g.add_node("Linear", [x], weights={"weight": w})


def test_format_and_networkx():
    g, *_ = small_graph()
    text = g.format()
    assert "RMSNorm(%x)" in text and "Linear(" in text and "return" in text
    nxg = g.to_networkx()
    assert nxg.number_of_edges() == 1
