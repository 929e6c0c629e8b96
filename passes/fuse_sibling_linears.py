"""fuse_sibling_linears: Linears that read the same value become one, split by Slices.

A decoder layer's q/k/v projections read the same normalized activations, and
so do the MLP's gate and up projections. On the CPU each matmul is a kernel call
with its own fixed cost and its own pass over the input (for block-quantized
weights, also its own block sums and offsets product), so one matmul over the
concatenated weights followed by cheap column slices does the same work in
fewer, larger calls: per SmolLM2 layer 4 matmuls instead of 7. The decode graph
(``fuse_decode_graph``) then hands a fused q/k/v result to ONNX Runtime's
attention node packed, without slicing it.

Merged: ``Linear`` nodes (float32 weights), ``BlockQLinear`` nodes with the
same bits and block size, and W8A8 ``QLinear`` nodes with the same activation
grid and per-channel weight scales, all with or all without a bias, reading the
same value as their input. Their weights are concatenated along the output
features (for ``BlockQLinear``: codes, scales and zero points by rows, offsets by columns; for
``QLinear``: int8 codes by columns, scales by rows), so the results are the same
numbers. A ``QLinear`` with one per-tensor weight scale (``--weight-granularity
tensor``) is left alone: one scale for the concatenation would cost precision.

A W8A8 layer then quantizes its normalized input once for q/k/v and once for
gate/up. The ``ShadowOutliers`` that corrects merged results already holds their
concatenated codes, which it then reads from the merged weights (no second
copy); when the corrected results are read by static ops
(gate/up: the activation and the product) the pass hands it the merged result
whole and slices after the correction, one add instead of a split and one add per
part. q/k/v keep their slices before the correction: after it they would sit
between two CPU ops (the correction and attention) and make a graph of their own
in the chunk program.

Run it after the quantization passes and before ``chunk_static_graphs``.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from llmc.analyses import ChunkPlan
from llmc.errors import CompileError
from llmc.ir import Graph, Node
from llmc.ops import sliced_whole
from llmc.pass_manager import Pass, PassContext, PassResult

log = logging.getLogger(__name__)

# how each weight of a mergeable op concatenates: the axis of its output features
_AXES = {
    "Linear": {"weight": 0, "bias": 0},
    "BlockQLinear": {"qweight": 0, "scales": 0, "offsets": 1, "zero_points": 0, "bias": 0},
    "QLinear": {"qweight": 1, "wscale": 0, "bias": 0},
}


def _key(n: Node) -> tuple | None:
    """Nodes with equal keys that read the same value can be merged; None if ``n`` cannot."""
    if n.op not in _AXES:
        return None
    if n.op == "QLinear" and n.weights["wscale"].shape == (1,):  # a per-tensor weight scale
        return None
    return (n.op, tuple(sorted(n.attrs.items())), tuple(sorted(n.weights)))


def _merged_name(names: list[str]) -> str:
    """``model.layers.0.self_attn.q_proj+k_proj+v_proj`` (``...mlp.gate_proj+up_proj.weight.q4b``): the
    common dotted prefix and suffix around the parts that differ."""
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind(".") + 1]
    rests = [n[len(prefix):] for n in names]
    suffix = os.path.commonprefix([r[::-1] for r in rests])[::-1]
    suffix = suffix[suffix.find(".") :] if "." in suffix else ""
    return prefix + "+".join(r[: len(r) - len(suffix)] for r in rests) + suffix


class FuseSiblingLinears(Pass):
    name = "fuse_sibling_linears"
    summary = "one matmul for the Linears that read the same value (q/k/v, gate/up), split by Slices"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if ctx.has(ChunkPlan):  # the plan names the nodes this pass replaces
            raise CompileError("fuse_sibling_linears rewrites the IR after chunk_static_graphs has cut it",
                               hint="put fuse_sibling_linears before chunk_static_graphs in --pipeline")
        store = graph.weights
        order = {n.name: i for i, n in enumerate(graph.nodes)}  # merging keeps the original nodes' relative order
        merged = 0
        for node in list(graph.nodes):  # every value is produced by a node or is a graph input; merge per producer's outputs
            for value in list(node.outputs):
                groups: dict[tuple, list[Node]] = {}
                for user, index in value.uses:
                    key = _key(user)
                    if key is not None and index == 0:
                        groups.setdefault(key, []).append(user)
                for members in groups.values():
                    if len(members) > 1:
                        fused = self._merge(graph, store, sorted(members, key=lambda n: order[n.name]))
                        merged += 1
                        if fused.op == "QLinear":
                            self._share_codes(fused)
                            self._shadow_whole(graph, fused)
        if merged:
            log.info("%s: %d groups of Linears merged", self.name, merged)
        return PassResult(merged > 0)

    @staticmethod
    def _merge(graph: Graph, store, members: list[Node]) -> Node:
        """Replace ``members`` (in graph order) by one node over their concatenated weights and a Slice per member."""
        first = members[0]
        name = _merged_name([n.name for n in members])
        weights = {}
        for key, axis in _AXES[first.op].items():
            if key not in first.weights:
                continue
            refs = [n.weights[key] for n in members]
            shape = list(refs[0].shape)
            shape[axis] = sum(r.shape[axis] for r in refs)

            def load(refs=refs, axis=axis):
                return np.concatenate([np.asarray(store.load(r.name)) for r in refs], axis=axis)

            weights[key] = store.derived(_merged_name([r.name for r in refs]), tuple(shape), refs[0].dtype, load)
        fused = graph.add_node(first.op, [first.inputs[0]], attrs=dict(first.attrs), weights=weights, name=name, before=first)
        start = 0
        for n in members:
            width = n.outputs[0].shape[-1]
            part = graph.add_node("Slice", [fused.outputs[0]], attrs={"start": start, "end": start + width}, name=f"{n.name}.slice", before=first)
            graph.replace_all_uses(n.outputs[0], part.outputs[0])
            start += width
        for n in members:
            graph.remove_node(n)
        return fused

    @staticmethod
    def _shadow_whole_of(fused: Node) -> Node | None:
        """The ``ShadowOutliers`` that corrects exactly the slices of ``fused`` (in their order and widths), or None."""
        readers = [u for u, _ in fused.outputs[0].uses]
        sh = next((u for s in readers if s.op == "Slice" for u, _ in s.outputs[0].uses), None)
        # all of fused's readers are the slices sh corrects, in order and covering it (sliced_whole)
        if sh is None or sh.op != "ShadowOutliers" or sliced_whole(sh) is not fused.outputs[0] or len(readers) != len(sh.inputs) - 1:
            return None
        return sh

    @classmethod
    def _share_codes(cls, fused: Node) -> None:
        """The correction of ``fused``'s slices reads the merged codes and scales: they are its table's
        columns in the same order, so its own concatenated copy is no longer written."""
        sh = cls._shadow_whole_of(fused)
        if sh is not None and sh.weights["codes"].dtype == fused.weights["qweight"].dtype:
            sh.weights["codes"], sh.weights["scale"] = fused.weights["qweight"], fused.weights["wscale"]

    @classmethod
    def _shadow_whole(cls, graph: Graph, fused: Node) -> None:
        """If one ``ShadowOutliers`` corrects exactly the slices of ``fused`` (in their order and
        widths), let it correct ``fused`` whole and slice its result instead."""
        sh = cls._shadow_whole_of(fused)
        if sh is None:
            return
        ys = sh.inputs[1:]
        if any(not u.schema.is_static for y in sh.outputs for u, _ in y.uses):
            # q/k/v read by attention: slices after the correction would sit between two CPU ops and
            # make a graph of their own in the chunk program (an NPU call for three views)
            return
        whole = graph.add_node("ShadowOutliers", [sh.inputs[0], fused.outputs[0]], attrs={**sh.attrs, "splits": [fused.outputs[0].shape[-1]]},
                               weights=dict(sh.weights), name=f"{sh.name}.whole", before=sh)
        i = graph.nodes.index(sh) + 1
        after = graph.nodes[i] if i < len(graph.nodes) else None  # None: append at the end
        names = {whole: sh.name}
        for y, old in zip(ys, sh.outputs):
            part = graph.add_node("Slice", [whole.outputs[0]], attrs=dict(y.producer.attrs), name=f"{y.producer.name}.whole", before=after)
            graph.replace_all_uses(old, part.outputs[0])
            names[part] = y.producer.name
        graph.remove_node(sh)
        for y in ys:
            graph.remove_node(y.producer)
        for node, name in names.items():  # the names the nodes they replace had
            graph.rename(node, name)
