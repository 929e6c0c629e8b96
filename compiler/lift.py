"""Frontend: trace a HuggingFace causal LM with ``torch.export`` and lift it to llmc IR.

The model is exported at a static shape (``[1, rows]`` token ids, no KV cache).
The resulting aten graph has a few hundred nodes per layer; lifting groups them
into LLM-level ops using the module hierarchy torch.export records on every node
(``nn_module_stack``):

==========================  ================================================
module class                IR op
==========================  ================================================
``nn.Linear``               ``Linear`` (weight, optional bias)
``nn.Embedding``            ``Embedding``
``*RMSNorm``                ``RMSNorm`` (eps and the Gemma ``1 + w`` offset read from the aten ops)
``nn.LayerNorm``            ``LayerNorm``
``*RotaryEmbedding``        ``RotaryTable`` (inv_freq buffer, attention scaling)
``*Attention`` (the rest)   ``Attention`` around ``scaled_dot_product_attention``
==========================  ================================================

Aten ops outside those modules (residual adds, the gated-MLP product,
activations, the Gemma embedding scale, splits of fused projections) are lifted
one by one; shape plumbing (views, dtype casts) disappears. Nodes that do not
depend on the token ids (position ids, the causal mask) are index plumbing: the
positions become a graph input and the mask is implied by ``Attention``.

Anything else is an error naming the aten op and the module it sits in.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from typing import Any

from llmc.checkpoint import Checkpoint
from llmc.errors import UnsupportedModelError
from llmc.ir import Graph, Value, WeightStore
from llmc.model_source import SUPPORTED_MODEL_TYPES

log = logging.getLogger(__name__)

# Ops that only move data or change dtype/metadata: lifted as identity.
_IDENTITY = {
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other", "aten.clone.default",
    "aten.contiguous.default", "aten.alias.default", "aten.detach.default", "aten.dropout.default",
    "aten.type_as.default", "aten.lift_fresh_copy.default",
}
_NO_OUTPUT = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default"}
_RESHAPES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default"}

# What may appear inside each recognised module besides the ops the lifter reads.
_NORM_OPS = _IDENTITY | _NO_OUTPUT | {"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor", "aten.rsqrt.default", "aten.mul.Tensor", "aten.float.default"}
_ROTARY_OPS = _IDENTITY | _NO_OUTPUT | _RESHAPES | {
    "aten.mul.Tensor", "aten.cat.default", "aten.cos.default", "aten.sin.default", "aten.expand.default",
    "aten.matmul.default", "aten.transpose.int", "aten.bmm.default", "aten.slice.Tensor", "aten.float.default",
}
_ATTENTION_OPS = _IDENTITY | _NO_OUTPUT | _RESHAPES | {
    "aten.transpose.int", "aten.expand.default", "aten.slice.Tensor", "aten.neg.default", "aten.cat.default",
    "aten.mul.Tensor", "aten.add.Tensor", "aten.scaled_dot_product_attention.default", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.chunk.default",
}


def trace(model: Any, rows: int):
    """``torch.export`` the model on ``[1, rows]`` token ids without a KV cache."""
    import torch

    param = next(model.parameters(), None)
    ids = torch.zeros((1, rows), dtype=torch.long, device=param.device if param is not None else "cpu")
    try:
        with torch.no_grad():
            return torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False)
    except Exception as e:
        raise UnsupportedModelError(
            f"torch.export failed on {type(model).__name__} at {rows} tokens: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            hint="llmc traces with torch.export (strict=False); models with data-dependent control flow cannot be compiled",
        ) from e


def _target(n) -> str:
    return str(n.target)


def _cls(entry) -> str:
    t = entry[1]
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


def _region_kind(cls: str) -> str | None:
    short = cls.rsplit(".", 1)[-1]
    if cls == "torch.nn.modules.linear.Linear":
        return "linear"
    if cls == "torch.nn.modules.sparse.Embedding" or (short.endswith("Embedding") and not short.endswith("RotaryEmbedding")):
        return "embedding"
    if cls == "torch.nn.modules.normalization.LayerNorm":
        return "layernorm"
    if short.endswith("RMSNorm"):
        return "rmsnorm"
    if short.endswith("RotaryEmbedding"):
        return "rotary"
    if short.endswith("Attention"):
        return "attention"
    if short in _GELU_TANH_MODULES:
        return "gelu_tanh"
    return None


# transformers modules that spell out 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in
# element-wise ops (Phi, GPT-2 style "gelu_new" / "gelu_fast"): lifted whole as one Act.
_GELU_TANH_MODULES = {"NewGELUActivation", "FastGELUActivation", "GELUTanh", "PytorchGELUTanh"}
_GELU_TANH_OPS = {"aten.pow.Tensor_Scalar", "aten.mul.Tensor", "aten.add.Tensor", "aten.tanh.default", "aten.gelu.default"}


def _as2d(shape) -> tuple[int, int] | None:
    dims = [int(d) for d in shape]
    while len(dims) > 2 and dims[0] == 1:
        dims = dims[1:]
    return (dims[0], dims[1]) if len(dims) == 2 else None


def _shape(n) -> tuple[int, ...]:
    v = n.meta.get("val")
    return tuple(int(d) for d in v.shape)


class _Lifter:
    def __init__(self, ep, model, name: str, checkpoint) -> None:
        import torch

        self.torch = torch
        self.ep = ep
        self.model = model
        self.checkpoint = checkpoint
        self.config = model.config
        sig = ep.graph_signature
        self.param_of = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        self.user_inputs = list(sig.user_inputs)
        self.graph = Graph(name, WeightStore())
        self.env: dict[Any, Any] = {}
        self.positions: Value | None = None
        self.layer = 0
        self._weight_keys: dict[tuple, str] = {}
        self.nodes = [n for n in ep.graph.nodes]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.region_of: dict[Any, str] = {}
        self.region_kind: dict[str, str] = {}
        self.region_class: dict[str, str] = {}
        self.regions: dict[str, list] = {}
        self.data: set = set()

    # -- helpers -------------------------------------------------------------
    def unsupported(self, n, why: str):
        stack = n.meta.get("nn_module_stack") or {}
        where = ""
        if stack:
            path, cls = list(stack.values())[-1][0], _cls(list(stack.values())[-1])
            where = f" in module {path or '<root>'} ({cls.rsplit('.', 1)[-1]})"
        mt = getattr(self.config, "model_type", "?")
        return UnsupportedModelError(
            f"{type(self.model).__name__} ({mt}): unsupported op {_target(n)}{where}: {why}",
            hint="llmc lowers the LLM ops listed by `llmc ops`; file an issue with this message to add the pattern",
        )

    def tensor_of(self, placeholder) -> Any:
        target = self.param_of[placeholder.name]
        if target in self.ep.state_dict:
            return self.ep.state_dict[target]
        return self.ep.constants[target]

    def weight(self, placeholder):
        t = self.tensor_of(placeholder)
        # Meta tensors (planning from a config) have no storage: tied weights are the same object.
        key = (id(t),) if t.is_meta else (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in self._weight_keys:  # tied weights (lm_head = embed_tokens) are stored once
            return self.graph.weights[self._weight_keys[key]]
        name = self.param_of[placeholder.name]
        self._weight_keys[key] = name
        torch = self.torch
        if t.is_meta and self.checkpoint is not None:  # read from the checkpoint when a pass or the backend asks
            load = functools.partial(self.checkpoint.load, name)
        else:
            def load(t=t):
                return t.detach().to(torch.float32).contiguous().numpy()

        return self.graph.weights.add(name, tuple(t.shape), "float32", load)

    def is_param(self, n) -> bool:
        return n.op == "placeholder" and n.name in self.param_of

    def value(self, n) -> Value:
        v = self.env.get(n)
        if not isinstance(v, Value):
            raise self.unsupported(n, "its result is used as a tensor but was not lifted to one")
        return v

    @staticmethod
    def arg_nodes(n):
        out = []

        def visit(a):
            if hasattr(a, "op") and hasattr(a, "target"):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    visit(x)
            elif isinstance(a, dict):
                for x in a.values():
                    visit(x)

        visit(n.args)
        visit(n.kwargs)
        return out

    # -- analysis ------------------------------------------------------------
    def classify(self) -> None:
        ids_name = self.user_inputs[0] if self.user_inputs else None
        for n in self.nodes:
            if n.op == "placeholder":
                if n.name == ids_name:
                    self.data.add(n)
                continue
            if n.op != "call_function":
                continue
            if any(a in self.data for a in self.arg_nodes(n)):
                self.data.add(n)
            stack = n.meta.get("nn_module_stack") or {}
            for entry in reversed(list(stack.values())):
                cls = _cls(entry)
                kind = _region_kind(cls)
                if kind:
                    key = entry[0]
                    self.region_of[n] = key
                    self.region_kind[key] = kind
                    self.region_class[key] = cls
                    self.regions.setdefault(key, []).append(n)
                    break

    def ext_inputs(self, key: str) -> list:
        seen, out = set(), []
        for n in self.regions[key]:
            for a in self.arg_nodes(n):
                if self.region_of.get(a) != key and a not in seen:
                    seen.add(a)
                    out.append(a)
        return out

    def ext_outputs(self, key: str) -> list:
        return [n for n in self.regions[key] if any(self.region_of.get(u) != key for u in n.users)]

    def check_ops(self, key: str, allowed: set) -> None:
        for n in self.regions[key]:
            if _target(n) not in allowed:
                raise self.unsupported(n, f"not expected inside {self.region_class[key].rsplit('.', 1)[-1]}")

    # -- main loop -------------------------------------------------------------
    def run(self) -> Graph:
        self.classify()
        last = {key: nodes[-1] for key, nodes in self.regions.items()}
        ids_name = self.user_inputs[0]
        rows = None
        for n in self.nodes:
            if n.op == "placeholder":
                if n.name == ids_name:
                    rows = _shape(n)[-1]
                    self.env[n] = self.graph.add_input("input_ids", (rows,), "int64")
                continue
            if n.op == "output":
                self.finish(n)
                continue
            key = self.region_of.get(n)
            if key is not None:
                if n is last[key]:
                    getattr(self, "lift_" + self.region_kind[key])(key)
                continue
            if n in self.data:
                self.lift_elementwise(n)
        self.graph.model_info.update(self.model_facts())
        return self.graph

    def finish(self, out) -> None:
        first = out.args[0][0] if isinstance(out.args[0], (list, tuple)) else out.args[0]
        logits = self.value(first)
        self.graph.set_outputs([logits])

    def model_facts(self) -> dict[str, Any]:
        c = self.config
        mt = c.model_type
        return {
            "model_type": mt,
            "family": SUPPORTED_MODEL_TYPES.get(mt, mt),
            "architecture": type(self.model).__name__,
            "num_layers": int(c.num_hidden_layers),
            "hidden_size": int(c.hidden_size),
            "vocab_size": int(c.vocab_size),
            "num_attention_layers": self.layer,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
        }

    # -- regions ---------------------------------------------------------------
    def passthrough_source(self, n, key: str):
        """If ``n`` is only a dtype cast/copy of a region input, that input."""
        while self.region_of.get(n) == key:
            if _target(n) not in _IDENTITY:
                return None
            n = n.args[0]
        return n

    def single_output(self, key: str):
        outs = []
        for o in self.ext_outputs(key):
            src = self.passthrough_source(o, key)
            if src is not None:
                self.env[o] = self.value(src)
            else:
                outs.append(o)
        if len(outs) != 1:
            raise self.unsupported(self.regions[key][-1], f"expected one result from {key}, found {len(outs)}")
        return outs[0]

    def data_input(self, key: str):
        data = [a for a in self.ext_inputs(key) if a in self.data]
        if len(data) != 1:
            raise self.unsupported(self.regions[key][0], f"expected one activation input to {key}, found {len(data)}")
        return data[0]

    def lift_linear(self, key: str) -> None:
        nodes = [n for n in self.regions[key] if _target(n) == "aten.linear.default"]
        self.check_ops(key, _IDENTITY | _NO_OUTPUT | {"aten.linear.default"})
        if len(nodes) != 1:
            raise self.unsupported(self.regions[key][0], "a Linear module must trace to exactly one aten.linear")
        n = nodes[0]
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        weights = {"weight": self.weight(w)}
        if b is not None:
            weights["bias"] = self.weight(b)
        node = self.graph.add_node("Linear", [self.value(x)], weights=weights, name=key)
        self.env[self.single_output(key)] = node.outputs[0]

    def lift_gelu_tanh(self, key: str) -> None:
        self.check_ops(key, _IDENTITY | _NO_OUTPUT | _GELU_TANH_OPS)
        node = self.graph.add_node("Act", [self.value(self.data_input(key))], attrs={"kind": "gelu_tanh"}, name=key)
        self.env[self.single_output(key)] = node.outputs[0]

    def lift_embedding(self, key: str) -> None:
        self.check_ops(key, _IDENTITY | _NO_OUTPUT | {"aten.embedding.default", "aten.mul.Tensor"})
        (n,) = [n for n in self.regions[key] if _target(n) == "aten.embedding.default"]
        scale = 1.0
        for m in self.regions[key]:  # scaled embeddings (Gemma): table[ids] * constant
            if _target(m) == "aten.mul.Tensor":
                c = [self.const_scalar(a) for a in m.args[:2]]
                c = [x for x in c if x is not None]
                if len(c) != 1:
                    raise self.unsupported(m, f"{key}: only a constant scale may follow the embedding gather")
                scale *= c[0]
        node = self.graph.add_node("Embedding", [self.value(n.args[1])], attrs={"scale": scale}, weights={"table": self.weight(n.args[0])}, name=key)
        self.env[self.single_output(key)] = node.outputs[0]

    def lift_layernorm(self, key: str) -> None:
        self.check_ops(key, _IDENTITY | _NO_OUTPUT | {"aten.layer_norm.default"})
        (n,) = [n for n in self.regions[key] if _target(n) == "aten.layer_norm.default"]
        args = list(n.args) + [None] * (5 - len(n.args))
        x, _shape_, w, b, eps = args[:5]
        weights = {"weight": self.weight(w)}
        if b is not None:
            weights["bias"] = self.weight(b)
        node = self.graph.add_node("LayerNorm", [self.value(x)], attrs={"eps": float(eps if eps is not None else 1e-5)}, weights=weights, name=key)
        self.env[self.single_output(key)] = node.outputs[0]

    def lift_rmsnorm(self, key: str) -> None:
        self.check_ops(key, _NORM_OPS)
        nodes = self.regions[key]
        params = [a for a in self.ext_inputs(key) if self.is_param(a)]
        if len(params) != 1:
            raise self.unsupported(nodes[0], f"expected one weight in {key}, found {len(params)}")
        w = params[0]
        means = [n for n in nodes if _target(n) == "aten.mean.dim"]
        eps = None
        offset = 0.0
        derived_from_w = {w}
        for n in nodes:
            if any(a in derived_from_w for a in self.arg_nodes(n)) and _target(n) in _IDENTITY | {"aten.float.default"}:
                derived_from_w.add(n)
        for n in nodes:
            if _target(n) != "aten.add.Tensor":
                continue
            a, b = n.args[0], n.args[1]
            if a in means and isinstance(b, (int, float)):
                eps = float(b)
            elif isinstance(b, (int, float)) and a in derived_from_w:
                offset = float(b)
            elif isinstance(a, (int, float)) and b in derived_from_w:
                offset = float(a)
        if eps is None or len(means) != 1:
            raise self.unsupported(nodes[0], f"{key} does not have the RMSNorm shape x*rsqrt(mean(x^2)+eps)*w")
        x = self.data_input(key)
        node = self.graph.add_node("RMSNorm", [self.value(x)], attrs={"eps": eps, "offset": offset}, weights={"weight": self.weight(w)}, name=key)
        self.env[self.single_output(key)] = node.outputs[0]

    def lift_rotary(self, key: str) -> None:
        self.check_ops(key, _ROTARY_OPS)
        nodes = self.regions[key]
        ins = self.ext_inputs(key)
        bufs = [a for a in ins if self.is_param(a) and "original" not in self.param_of[a.name]]
        used_bufs = [a for a in bufs if a.users and any(self.region_of.get(u) == key and _target(u) != "aten._assert_tensor_metadata.default" for u in a.users)]
        pos = [a for a in ins if not self.is_param(a) and a not in self.data]
        if len(used_bufs) != 1 or len(pos) != 1:
            raise self.unsupported(nodes[0], f"{key}: expected an inv_freq buffer and position ids as inputs")
        if not any(_target(n) == "aten.cat.default" for n in nodes):
            raise self.unsupported(nodes[0], f"{key}: only the 'rotate half' rotary layout (cat(freqs, freqs)) is supported")
        outs = self.ext_outputs(key)
        cos_out = sin_out = None
        scaling = 1.0
        for o in outs:
            chain = self.backward(o, key)
            kinds = {_target(n) for n in chain}
            if "aten.cos.default" in kinds:
                cos_out = o
            elif "aten.sin.default" in kinds:
                sin_out = o
            for n in chain:
                if _target(n) == "aten.mul.Tensor" and isinstance(n.args[1], (int, float)):
                    scaling = float(n.args[1])
        if cos_out is None or sin_out is None:
            raise self.unsupported(nodes[-1], f"{key}: could not find the cos and sin tables")
        if self.positions is None:
            self.positions = self.graph.add_input("positions", (self.graph.inputs[0].shape[0],), "int64")
        self.env[pos[0]] = self.positions
        node = self.graph.add_node("RotaryTable", [self.positions], attrs={"scaling": scaling}, weights={"inv_freq": self.weight(used_bufs[0])}, name=key)
        if node.outputs[0].shape[1] != _shape(cos_out)[-1]:
            raise self.unsupported(cos_out, f"{key}: table width {_shape(cos_out)[-1]} is not twice the inv_freq length")
        self.env[cos_out], self.env[sin_out] = node.outputs

    def backward(self, n, key: str) -> list:
        """Nodes of region ``key`` that ``n`` depends on (including n)."""
        out, stack, seen = [], [n], set()
        while stack:
            m = stack.pop()
            if m in seen or self.region_of.get(m) != key:
                continue
            seen.add(m)
            out.append(m)
            stack.extend(self.arg_nodes(m))
        return out

    def sources(self, n, key: str) -> tuple[list, list]:
        """External inputs that ``n`` depends on, and the region slices applied to them."""
        chain = self.backward(n, key)
        chain_set = set(chain)
        ext, slices = [], []
        for m in chain:
            for a in self.arg_nodes(m):
                if a not in chain_set and a not in ext:
                    ext.append(a)
            if _target(m) == "aten.slice.Tensor" and m.args[0] not in chain_set and m.args[0] in self.data:
                slices.append(m)
        return ext, slices

    def lift_attention(self, key: str) -> None:
        self.check_ops(key, _ATTENTION_OPS)
        nodes = self.regions[key]
        sdpa = [n for n in nodes if _target(n) == "aten.scaled_dot_product_attention.default"]
        if len(sdpa) != 1:
            raise self.unsupported(nodes[0], f"{key} must contain exactly one scaled_dot_product_attention (load with attn_implementation='sdpa')")
        s = sdpa[0]
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        args = dict(zip(names, s.args))
        args.update(s.kwargs)
        mask = args.get("attn_mask")
        if mask is None and not args.get("is_causal", False):
            raise self.unsupported(s, f"{key}: attention is neither causal nor masked")
        if mask is not None and mask in self.data:
            raise self.unsupported(s, f"{key}: the attention mask depends on the tokens; only causal (optionally sliding-window) masks are supported")
        tables: list[Value] = []
        picked: list[Value] = []
        for role in ("query", "key", "value"):
            ext, slices = self.sources(args[role], key)
            data = [a for a in ext if a in self.data]
            rope = [a for a in ext if isinstance(self.env.get(a), Value) and self.env[a].producer is not None and self.env[a].producer.op == "RotaryTable"]
            if len(data) != 1:
                raise self.unsupported(s, f"{key}: the {role} comes from {len(data)} activations, expected one projection")
            v = self.value(data[0])
            if slices:
                sl = slices[0]
                dim = sl.args[1] if len(sl.args) > 1 else 0
                start = sl.args[2] if len(sl.args) > 2 else 0
                end = sl.args[3] if len(sl.args) > 3 else None
                width = v.shape[-1]
                end = width if end is None or end > width else end
                if dim not in (-1, len(_shape(sl)) - 1):
                    raise self.unsupported(sl, f"{key}: splitting the fused projection on dim {dim}")
                v = self.graph.add_node("Slice", [v], attrs={"start": int(start), "end": int(end)}, name=f"{key}.{role[0]}_slice").outputs[0]
            picked.append(v)
            if role != "value":
                tables.append(tuple(self.env[a] for a in rope))
        qshape = _shape(args["query"])
        heads, head_dim = qshape[1], qshape[-1]
        kv_heads = picked[1].shape[-1] // head_dim
        scale = args.get("scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        inputs = list(picked)
        rotary_dim = 0
        if tables[0] or tables[1]:
            if len(tables[0]) != 2 or set(tables[0]) != set(tables[1]):
                raise self.unsupported(s, f"{key}: rotary embedding must be applied to both query and key with the same tables")
            cos, sin = sorted(tables[0], key=lambda v: v.producer.outputs.index(v))
            if not any(_target(n) == "aten.neg.default" for n in nodes):
                raise self.unsupported(s, f"{key}: rotary embedding without rotate_half (neg/cat) is not supported")
            rotary_dim = cos.shape[1]
            inputs += [cos, sin]
        window = self.sliding_window(self.layer)
        node = self.graph.add_node(
            "Attention",
            inputs,
            attrs={
                "layer": self.layer,
                "num_heads": heads,
                "num_kv_heads": kv_heads,
                "head_dim": head_dim,
                "scale": scale,
                "rotary_dim": rotary_dim,
                "sliding_window": window,
            },
            name=key,
        )
        self.layer += 1
        out = self.single_output(key)
        if _as2d(_shape(out)) != node.outputs[0].shape:
            raise self.unsupported(out, f"{key}: attention output shape {_shape(out)} is not [rows, heads*head_dim]")
        self.env[out] = node.outputs[0]

    def sliding_window(self, layer: int) -> int:
        c = self.config
        window = getattr(c, "sliding_window", None)
        if not window:
            return 0
        types = getattr(c, "layer_types", None)
        if types is not None:
            return int(window) if types[layer] == "sliding_attention" else 0
        if getattr(c, "use_sliding_window", True) is False:
            return 0
        return int(window)

    # -- element-wise ops outside recognised modules ------------------------------
    def const_scalar(self, a) -> float | None:
        """The value of a Python number or a one-element constant tensor (through casts)."""
        if isinstance(a, (int, float)):
            return float(a)
        while hasattr(a, "op") and a.op == "call_function" and _target(a) in _IDENTITY and a not in self.data:
            a = a.args[0]
        if hasattr(a, "op") and self.is_param(a):
            t = self.tensor_of(a)
            if t.numel() == 1:
                if not t.is_meta:
                    return float(t.reshape(()).item())
                if self.checkpoint is not None:
                    return float(self.checkpoint.load(self.param_of[a.name]).reshape(()))
                return float("nan")  # planning from a config (meta tensors): the value is unknown and unused
        return None

    def lift_elementwise(self, n) -> None:
        t = _target(n)
        if t in _NO_OUTPUT:
            return
        if t in _IDENTITY:
            self.env[n] = self.value(n.args[0])
            return
        if n.op == "call_function" and n.target is operator.getitem:
            self.env[n] = self.env[n.args[0]][n.args[1]]
            return
        if t in _RESHAPES:
            src = self.value(n.args[0])
            if _as2d(_shape(n)) != src.shape:
                raise self.unsupported(n, f"reshape {src.shape} -> {_shape(n)} changes the [rows, features] layout")
            self.env[n] = src
            return
        if t == "aten.slice.Tensor":
            src = self.value(n.args[0])
            rank = len(_shape(n))
            dim = n.args[1] if len(n.args) > 1 else 0
            dim = dim % rank
            out2d = _as2d(_shape(n))
            if out2d == src.shape:
                self.env[n] = src
            elif dim == rank - 1 and out2d is not None and out2d[0] == src.shape[0]:
                start = int(n.args[2]) if len(n.args) > 2 and n.args[2] is not None else 0
                end = min(int(n.args[3]), src.shape[1]) if len(n.args) > 3 and n.args[3] is not None else src.shape[1]
                self.env[n] = self.graph.add_node("Slice", [src], attrs={"start": start, "end": end}).outputs[0]
            else:
                raise self.unsupported(n, "slicing rows inside the model is not supported")
            return
        if t in ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default"):
            src = self.value(n.args[0])
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            if dim not in (-1, len(n.args[0].meta["val"].shape) - 1):
                raise self.unsupported(n, "only splits along the feature dimension are supported")
            width = src.shape[1]
            if t == "aten.chunk.default":
                k = int(n.args[1])
                sizes = [width // k] * k
            elif t == "aten.split.Tensor":
                step = int(n.args[1])
                sizes = [min(step, width - i) for i in range(0, width, step)]
            else:
                sizes = [int(s) for s in n.args[1]]
            parts, start = [], 0
            for size in sizes:
                parts.append(self.graph.add_node("Slice", [src], attrs={"start": start, "end": start + size}).outputs[0])
                start += size
            self.env[n] = tuple(parts)
            return
        if t in ("aten.add.Tensor", "aten.mul.Tensor"):
            a, b = n.args[0], n.args[1]
            if n.kwargs.get("alpha", 1) != 1:
                raise self.unsupported(n, "add with alpha")
            ca, cb = self.const_scalar(a), self.const_scalar(b)
            if t == "aten.mul.Tensor" and (ca is not None or cb is not None):
                src = self.value(b if ca is not None else a)
                self.env[n] = self.graph.add_node("Scale", [src], attrs={"value": ca if ca is not None else cb}).outputs[0]
                return
            if ca is not None or cb is not None:
                raise self.unsupported(n, "adding a constant to activations")
            va, vb = self.value(a), self.value(b)
            if va.shape != vb.shape:
                raise self.unsupported(n, f"broadcasting {va.shape} with {vb.shape}")
            self.env[n] = self.graph.add_node("Add" if t == "aten.add.Tensor" else "Mul", [va, vb]).outputs[0]
            return
        if t == "aten.silu.default":
            self.env[n] = self.graph.add_node("Act", [self.value(n.args[0])], attrs={"kind": "silu"}).outputs[0]
            return
        if t == "aten.gelu.default":
            approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
            kind = "gelu_tanh" if approx == "tanh" else "gelu"
            self.env[n] = self.graph.add_node("Act", [self.value(n.args[0])], attrs={"kind": kind}).outputs[0]
            return
        raise self.unsupported(n, "no lowering for this op outside the recognised modules")


def lift(ep, model, name: str = "model", checkpoint: Checkpoint | None = None) -> Graph:
    """Lift an exported program of ``model`` into a verified llmc :class:`Graph`.

    Parameters on the meta device are read from ``checkpoint`` when the weight
    store is asked for them (see :mod:`llmc.checkpoint`); without one they have
    shapes only, which is enough for planning.
    """
    graph = _Lifter(ep, model, name, checkpoint).run()
    graph.verify()
    log.info("lifted %s: %d IR nodes, %d weights", name, len(graph.nodes), len(graph.weights))
    return graph
