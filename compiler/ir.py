"""llmc's graph IR.

The IR is deliberately small. A :class:`Graph` holds :class:`Node` objects in
topological order; each node reads :class:`Value` objects and defines new ones.
Activations are two-dimensional ``[rows, features]``: the batch dimension is
always 1 and dropped, and the row dimension is the token dimension of a chunk.
Static ops (see :mod:`llmc.ops`) are row-wise, so a subgraph traced at ``rows =
C`` is equally valid at ``rows = 1``; the chunk pass relies on that.

Weights are never copied into nodes: a node names its weights through
:class:`WeightRef` handles into the graph's :class:`WeightStore`.

Every edit goes through a :class:`Graph` method that keeps the def-use lists
right; node inputs are an immutable tuple.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from llmc import ops as _ops
from llmc.errors import IRVerificationError


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """A handle to one tensor in a :class:`WeightStore`."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPE_SIZES[self.dtype]


_DTYPE_SIZES = {"float32": 4, "float16": 2, "int8": 1, "uint8": 1, "int32": 4, "int64": 8, "uint16": 2, "int16": 2}


class WeightStore:
    """Name -> tensor data, loaded lazily through a loader callable.

    The store owns the data; the IR only holds :class:`WeightRef` handles. A
    loader returns a contiguous numpy array for a name, so weights can come from
    a torch state dict, a safetensors file or a memory map without the IR caring.
    """

    def __init__(self) -> None:
        self._refs: dict[str, WeightRef] = {}
        self._loaders: dict[str, Callable[[], Any]] = {}

    def add(self, name: str, shape: Iterable[int], dtype: str, loader: Callable[[], Any]) -> WeightRef:
        if name in self._refs:
            raise ValueError(f"weight {name!r} is already in the store")
        ref = WeightRef(name, tuple(int(d) for d in shape), dtype)
        self._refs[name] = ref
        self._loaders[name] = loader
        return ref

    def derived(self, name: str, shape: Iterable[int], dtype: str, loader: Callable[[], Any]) -> WeightRef:
        """The weight ``name``, added with ``loader`` unless a pass already derived it (weights
        shared by several nodes, such as a tied embedding's, are derived once)."""
        return self._refs[name] if name in self._refs else self.add(name, shape, dtype, loader)

    def derived_together(self, specs: Iterable[tuple[str, Iterable[int], str]], loader: Callable[[], Sequence[Any]]) -> list[WeightRef]:
        """The weights ``specs`` (name, shape, dtype) that one ``loader`` call computes together
        (``loader()[i]`` is the i-th), each as :meth:`derived`. The call's result is kept until each
        array has been read once, so writing them one after another computes it once; a second read
        of an array computes it again."""
        held: dict[int, Any] = {}

        def part(i: int) -> Any:
            if i not in held:
                held.clear()
                held.update(enumerate(loader()))
            return held.pop(i)

        return [self.derived(name, shape, dtype, lambda i=i: part(i)) for i, (name, shape, dtype) in enumerate(specs)]

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def __getitem__(self, name: str) -> WeightRef:
        return self._refs[name]

    def __iter__(self) -> Iterator[WeightRef]:
        return iter(self._refs.values())

    def __len__(self) -> int:
        return len(self._refs)

    def load(self, name: str):
        """Return the tensor for ``name`` as a numpy array (not cached)."""
        return self._loaders[name]()


class Value:
    """An SSA value: defined once (by a node or as a graph input), used many times."""

    __slots__ = ("name", "shape", "dtype", "_producer", "_uses")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str = "float32") -> None:
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self._producer: Node | None = None
        self._uses: list[tuple[Node, int]] = []

    @property
    def producer(self) -> "Node | None":
        return self._producer

    @property
    def uses(self) -> tuple[tuple["Node", int], ...]:
        return tuple(self._uses)

    def __repr__(self) -> str:
        return f"%{self.name}:{self.dtype}{list(self.shape)}"


class Node:
    """One operation. ``inputs`` is immutable; edit through the graph."""

    __slots__ = ("op", "name", "_inputs", "_outputs", "attrs", "weights", "_graph")

    def __init__(self, op: str, name: str, attrs: Mapping[str, Any], weights: Mapping[str, WeightRef]) -> None:
        self.op = op
        self.name = name
        self._inputs: tuple[Value, ...] = ()
        self._outputs: tuple[Value, ...] = ()
        self.attrs = dict(attrs)
        self.weights = dict(weights)
        self._graph: Graph | None = None

    @property
    def inputs(self) -> tuple[Value, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[Value, ...]:
        return self._outputs

    @property
    def schema(self) -> _ops.OpDef:
        return _ops.get(self.op)

    def __repr__(self) -> str:
        return f"<Node {self.name} = {self.op}>"


class Graph:
    """A topologically ordered list of nodes with graph inputs and outputs."""

    def __init__(self, name: str = "model", weights: WeightStore | None = None) -> None:
        self.name = name
        self.weights = weights if weights is not None else WeightStore()
        self._nodes: list[Node] = []
        self._inputs: list[Value] = []
        self._outputs: list[Value] = []
        self._names: set[str] = set()  # node names
        self._value_names: set[str] = set()
        # Facts about the model the IR came from (family, sizes); read-only metadata.
        self.model_info: dict[str, Any] = {}

    # -- construction ------------------------------------------------------
    def _unique(self, base: str, pool: set[str] | None = None) -> str:
        pool = self._names if pool is None else pool
        name, i = base, 1
        while name in pool:
            name = f"{base}_{i}"
            i += 1
        pool.add(name)
        return name

    def add_input(self, name: str, shape: Iterable[int], dtype: str) -> Value:
        v = Value(self._unique(name, self._value_names), tuple(shape), dtype)
        self._inputs.append(v)
        return v

    def set_outputs(self, values: Iterable[Value]) -> None:
        self._outputs = list(values)

    def add_node(
        self,
        op: str,
        inputs: Iterable[Value],
        *,
        attrs: Mapping[str, Any] | None = None,
        weights: Mapping[str, WeightRef] | None = None,
        name: str | None = None,
        before: Node | None = None,
    ) -> Node:
        """Create a node, infer its outputs from the op schema, insert it.

        The node goes at the end, or just before ``before``.
        """
        opdef = _ops.get(op)
        node = Node(op, self._unique(name or op.lower()), attrs or {}, weights or {})
        node._graph = self
        inputs = tuple(inputs)
        node._inputs = inputs
        for i, v in enumerate(inputs):
            v._uses.append((node, i))
        shapes = opdef.infer(node)
        outs = []
        for k, (shape, dtype) in enumerate(shapes):
            v = Value(self._unique(node.name if len(shapes) == 1 else f"{node.name}.{k}", self._value_names), shape, dtype)
            v._producer = node
            outs.append(v)
        node._outputs = tuple(outs)
        if before is None:
            self._nodes.append(node)
        else:
            self._nodes.insert(self._nodes.index(before), node)
        return node

    # -- queries -----------------------------------------------------------
    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(self._nodes)

    @property
    def inputs(self) -> tuple[Value, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[Value, ...]:
        return tuple(self._outputs)

    def find(self, op: str) -> list[Node]:
        return [n for n in self._nodes if n.op == op]

    def downstream(self, op: str, within: Iterable[str] | None = None) -> list[Node]:
        """The nodes of type ``op`` and every node computed from them, in graph order; with ``within``
        (node names) only those nodes, the path followed through them alone."""
        keep = None if within is None else set(within)
        reached: set[str] = set()
        out = []
        for n in self._nodes:
            if keep is not None and n.name not in keep:
                continue
            if n.op == op or any(v.producer is not None and v.producer.name in reached for v in n.inputs):
                reached.add(n.name)
                out.append(n)
        return out

    def node(self, name: str) -> Node:
        for n in self._nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    # -- edits -------------------------------------------------------------
    def set_input(self, node: Node, index: int, value: Value) -> None:
        old = node._inputs[index]
        old._uses.remove((node, index))
        node._inputs = node._inputs[:index] + (value,) + node._inputs[index + 1 :]
        value._uses.append((node, index))

    def replace_all_uses(self, old: Value, new: Value, *, exclude: Node | None = None) -> None:
        """Point every use of ``old`` (and graph outputs) at ``new``."""
        for node, i in list(old._uses):
            if node is not exclude:
                self.set_input(node, i, new)
        self._outputs = [new if v is old else v for v in self._outputs]

    def move_after(self, node: Node, anchor: Node) -> None:
        """Reorder: put ``node`` right after ``anchor`` (verify() checks the order stays valid)."""
        self._nodes.remove(node)
        self._nodes.insert(self._nodes.index(anchor) + 1, node)

    def rename(self, node: Node, name: str) -> None:
        """Give ``node`` a name no node in the graph has (say, one a removed node had)."""
        if any(n.name == name for n in self._nodes if n is not node):
            raise IRVerificationError(f"cannot rename {node.name} to {name}: a node of that name exists")
        self._names.add(name)
        node.name = name

    def remove_node(self, node: Node) -> None:
        for v in node._outputs:
            if v._uses or v in self._outputs:
                raise IRVerificationError(
                    f"cannot remove {node.name} ({node.op}): its output {v.name} is still used by "
                    f"{[u.name for u, _ in v._uses] or 'the graph outputs'}; replace those uses first"
                )
        for i, v in enumerate(node._inputs):
            v._uses.remove((node, i))
        self._nodes.remove(node)
        node._graph = None

    # -- checking ----------------------------------------------------------
    def verify(self) -> None:
        """Check SSA form, def-use lists, topological order and op schemas.

        Raises :class:`IRVerificationError` naming the offending node and what
        to do about it.
        """
        defined: set[int] = {id(v) for v in self._inputs}
        for node in self._nodes:
            if node._graph is not self:
                raise IRVerificationError(f"node {node.name} ({node.op}) is listed in graph {self.name} but belongs to another graph")
            try:
                opdef = _ops.get(node.op)
            except KeyError:
                raise IRVerificationError(f"node {node.name} has unknown op {node.op!r}; register it in llmc.ops") from None
            for i, v in enumerate(node._inputs):
                if id(v) not in defined:
                    raise IRVerificationError(
                        f"node {node.name} ({node.op}) input {i} {v.name} is used before it is defined; "
                        "insert new nodes after their operands (Graph.add_node(before=...))"
                    )
                if (node, i) not in v._uses:
                    raise IRVerificationError(f"use-list of {v.name} lacks {node.name}[{i}]; edit inputs only through Graph.set_input")
            for v in node._outputs:
                if v._producer is not node:
                    raise IRVerificationError(f"value {v.name} claims producer {v._producer} but is an output of {node.name}")
                for user, i in v._uses:
                    if user._graph is not self or user._inputs[i] is not v:
                        raise IRVerificationError(f"stale use of {v.name} by {user.name}[{i}]; the node was removed or rewired behind the graph's back")
                defined.add(id(v))
            problem = opdef.check(node)
            if problem:
                raise IRVerificationError(f"node {node.name} ({node.op}): {problem}")
            for slot, ref in node.weights.items():
                if ref.name not in self.weights:
                    raise IRVerificationError(f"node {node.name} weight {slot} names {ref.name!r}, which is not in the weight store")
        for v in self._outputs:
            if id(v) not in defined:
                raise IRVerificationError(f"graph output {v.name} is never defined")

    # -- views -------------------------------------------------------------
    def to_networkx(self):
        """A networkx DiGraph over node names (edges carry the value name)."""
        import networkx as nx

        g = nx.DiGraph()
        for n in self._nodes:
            g.add_node(n.name, op=n.op)
        for n in self._nodes:
            for v in n._inputs:
                if v._producer is not None:
                    g.add_edge(v._producer.name, n.name, value=v.name)
        return g

    def format(self) -> str:
        """Human-readable listing, one node a line (used by --dump-ir)."""
        lines = [f"graph {self.name}({', '.join(repr(v) for v in self._inputs)}) {{"]
        for n in self._nodes:
            outs = ", ".join(repr(v) for v in n._outputs)
            ins = ", ".join(f"%{v.name}" for v in n._inputs)
            extra = []
            if n.weights:
                extra.append(", ".join(f"{k}=@{r.name}" for k, r in n.weights.items()))
            if n.attrs:
                extra.append(", ".join(f"{k}={_fmt_attr(v)}" for k, v in sorted(n.attrs.items())))
            tail = f" {{{'; '.join(extra)}}}" if extra else ""
            lines.append(f"  {outs} = {n.op}({ins}){tail}")
        lines.append(f"  return {', '.join('%' + v.name for v in self._outputs)}")
        lines.append("}")
        return "\n".join(lines)


def _fmt_attr(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return repr(v)
