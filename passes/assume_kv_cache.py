"""assume_kv_cache: an int8 KV cache without calibration, for planning from a config.

``llmc plan --kv-cache int8`` has no weights to calibrate on, but its memory
figure and the cost model's attention prices must count one byte per cached
element, as a bundle compiled with ``--kv-cache int8`` does. This pass gives
every ``Attention`` node the ``k_scale``/``v_scale`` weights that
``quantize_kv_cache`` would, with placeholder values (1.0). Never part of a
compile pipeline: the scales are placeholders.
"""

from __future__ import annotations

import numpy as np

from llmc.ir import Graph
from llmc.pass_manager import Pass, PassContext, PassResult


class AssumeKVCache(Pass):
    name = "assume_kv_cache"
    summary = "placeholder int8 KV cache scales (no calibration) so `llmc plan --kv-cache int8` prices the int8 cache"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        changed = False
        for n in graph.find("Attention"):
            shape = (n.attrs["num_kv_heads"], n.attrs["head_dim"])
            for slot in ("k_scale", "v_scale"):
                if slot not in n.weights:
                    n.weights[slot] = graph.weights.add(f"{n.name}.{slot}", shape, "float32", lambda s=shape: np.ones(s, np.float32))
                    changed = True
        return PassResult(changed)
