"""Pass manager contract and the structural effect of each pass."""

from __future__ import annotations

import pytest

from llmc.analyses import ChunkPlan
from llmc.errors import PassError, PipelineError
from llmc.pass_manager import CompileOptions, IRDump, PassContext, PassTiming, format_pipeline, parse_pipeline, run_pipeline
from llmc.passes import ALL_PASSES, DEFAULT_PIPELINES, REGISTRY


@pytest.fixture(scope="module")
def lifted(model_dirs):
    import torch
    import transformers as T

    from llmc.lift import lift, trace

    d = model_dirs("llama")

    def make():
        m = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
        return lift(trace(m, 8), m)

    return make


def test_pipeline_roundtrip():
    for text in DEFAULT_PIPELINES.values():
        assert format_pipeline(parse_pipeline(text, REGISTRY)) == text
    assert len({p.name for p in ALL_PASSES}) == len(ALL_PASSES)
    from llmc.passes import PIPELINE_USES

    assert set(PIPELINE_USES) == set(DEFAULT_PIPELINES)
    assert all(p.summary for p in ALL_PASSES)


def test_unknown_pass_is_named():
    with pytest.raises(PipelineError, match="unknown pass 'nope'"):
        parse_pipeline("dce,nope", REGISTRY)


def test_dce_removes_only_dead_nodes(lifted):
    g = lifted()
    ctx = PassContext(CompileOptions(chunk=8, max_context=64))
    before = [n.name for n in g.nodes]
    run_pipeline(g, parse_pipeline("dce", REGISTRY), ctx)
    assert [n.name for n in g.nodes] == before  # nothing dead in a lifted model
    x = g.outputs[0].producer.inputs[0]
    g.add_node("Act", [x], attrs={"kind": "silu"}, name="dead")
    run_pipeline(g, parse_pipeline("dce", REGISTRY), ctx)
    assert [n.name for n in g.nodes] == before


def test_select_logit_rows_moves_head_behind_selection(lifted):
    g = lifted()
    ctx = PassContext(CompileOptions(chunk=8, max_context=64))
    run_pipeline(g, parse_pipeline("select_logit_rows", REGISTRY), ctx)
    (sel,) = g.find("SelectRows")
    norm = sel.outputs[0].uses[0][0]
    assert norm.op == "RMSNorm" and norm.name == "model.norm"
    head = norm.outputs[0].uses[0][0]
    assert head.op == "Linear" and g.outputs[0] is head.outputs[0]
    assert g.outputs[0].shape == (1, g.model_info["vocab_size"])
    assert len(g.find("Linear")) == 7 * 2 + 1  # nothing else changed


def test_chunk_plan_shares_graphs_and_cuts_at_dynamic_ops(lifted):
    g = lifted()
    ctx = PassContext(CompileOptions(chunk=8, max_context=64))
    run_pipeline(g, parse_pipeline(DEFAULT_PIPELINES["cpu"], REGISTRY), ctx)
    plan = ctx.get(ChunkPlan)
    L = g.model_info["num_layers"]
    assert [s.name for s in plan.subgraphs] == [f"block{i:02d}" for i in range(L + 1)] + ["head"]
    assert all(s.row_counts == (8, 1) for s in plan.subgraphs)
    ops_in = {s.name: {g.node(n).op for n in s.nodes} for s in plan.subgraphs}
    assert all(g.node(n).schema.is_static for s in plan.subgraphs for n in s.nodes)
    assert ops_in["block00"] == {"RMSNorm", "Linear", "Slice"}  # norm + q/k/v (one matmul, sliced)
    assert ops_in["block01"] == {"Linear", "Slice", "Add", "RMSNorm", "Act", "Mul"}  # o_proj .. next q/k/v
    # every weight of a static op belongs to exactly one subgraph
    owned = [w for s in plan.subgraphs for w in s.weights]
    assert len(owned) == len(set(owned))
    kinds = [(st.kind, g.node(st.name).op if st.kind == "op" else st.name) for st in plan.steps]
    assert kinds[:4] == [("op", "Embedding"), ("op", "RotaryTable"), ("graph", "block00"), ("op", "Attention")]
    assert kinds[-2:] == [("op", "SelectRows"), ("graph", "head")]
    # program order respects data flow
    seen = {v.name for v in g.inputs}
    for st in plan.steps:
        assert set(st.inputs) <= seen, st
        seen.update(st.outputs)


def test_requires_are_checked():
    from llmc.pass_manager import Pass, PassResult

    class NeedsPlan(Pass):
        name = "needs_plan"
        summary = "test"
        requires = (ChunkPlan,)

        def run(self, graph, ctx):
            return PassResult(False)

    from llmc.ir import Graph

    with pytest.raises(PipelineError, match="needs ChunkPlan") as e:
        run_pipeline(Graph(), [NeedsPlan()], PassContext(CompileOptions()))
    assert e.value.exit_code == 2  # a usage error of --pipeline, not an internal one


def test_rewriting_the_ir_after_the_cut_is_a_pipeline_error(model_dirs, tmp_path):
    """A pass that changes the IR after chunk_static_graphs would leave a plan naming nodes that are gone
    or out of order: `llmc compile --pipeline` names the pass and where it goes (exit 2), nothing written."""
    from click.testing import CliRunner

    from llmc.cli import cli

    out = tmp_path / "b"
    r = CliRunner().invoke(cli, ["compile", str(model_dirs("llama")), "-o", str(out), "--chunk", "8", "--max-context", "32",
                                 "--pipeline", "dce,chunk_static_graphs,select_logit_rows"])
    assert r.exit_code == 2 and "pass select_logit_rows rewrote the IR after chunk_static_graphs cut it" in r.output, r.output
    assert "hint: put select_logit_rows before chunk_static_graphs" in r.output and not out.exists()


def test_failing_pass_names_itself_and_history(lifted):
    from llmc.pass_manager import Pass

    class Boom(Pass):
        name = "boom"
        summary = "test"

        def run(self, graph, ctx):
            raise ValueError("kaput")

    g = lifted()
    with pytest.raises(PassError, match=r"pass boom failed.*kaput.*already run: dce"):
        run_pipeline(g, [REGISTRY["dce"](), Boom()], PassContext(CompileOptions()))


def test_instruments_dump_and_time(lifted, tmp_path):
    g = lifted()
    timing, dump = PassTiming(), IRDump(tmp_path / "ir")
    run_pipeline(g, parse_pipeline(DEFAULT_PIPELINES["cpu"], REGISTRY), PassContext(CompileOptions(chunk=8, max_context=64)), [timing, dump])
    assert [r[0] for r in timing.rows] == DEFAULT_PIPELINES["cpu"].split(",")
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == ["00-input.ir", "01-dce.ir", "02-select_logit_rows.ir", "03-fuse_sibling_linears.ir", "04-chunk_static_graphs.ir",
                     "05-fuse_decode_graph.ir", "06-place.ir", "07-schedule.ir", "08-plan_offload.ir"]
    assert "SelectRows" in (tmp_path / "ir" / "02-select_logit_rows.ir").read_text()
    assert "SelectRows" not in (tmp_path / "ir" / "01-dce.ir").read_text()
