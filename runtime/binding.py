"""Running one graph instance through an ONNX Runtime IOBinding with reused outputs.

``InferenceSession.run`` converts every input, allocates every output and copies
it into a fresh numpy array on each call; for a one-row decode instance that
overhead is larger than the graph's own work. A :class:`BoundGraph` binds the
inputs by pointer (no copy) and writes the outputs into numpy buffers allocated
once, so a step costs one ``run_with_iobinding``.

The outputs are the same arrays on every call: use it only for a graph whose
results are consumed before it runs again (not for the logits handed to callers).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class BoundGraph:
    def __init__(self, session: Any, inputs: Sequence[str], outputs: Sequence[str], rows: int, features: Sequence[int], dtypes: Sequence[str],
                 constants: dict[str, np.ndarray] | None = None) -> None:
        self._session = session
        self._inputs = list(inputs)
        self._binding = session.io_binding()
        # inputs that never change (weights fed as inputs), bound once; the arrays must outlive the binding
        self._constants = {n: np.ascontiguousarray(a) for n, a in (constants or {}).items()}
        for name, a in self._constants.items():
            self._binding.bind_input(name, "cpu", 0, a.dtype.type, list(a.shape), a.ctypes.data)
        self.outputs = [np.empty((rows, f), np.dtype(d)) for f, d in zip(features, dtypes)]
        for name, arr in zip(outputs, self.outputs):
            self._binding.bind_output(name, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)

    def __call__(self, ins: Sequence[np.ndarray]) -> list[np.ndarray]:
        held = []  # the bound inputs must outlive the run
        for name, x in zip(self._inputs, ins):
            x = np.ascontiguousarray(x)
            held.append(x)
            self._binding.bind_input(name, "cpu", 0, x.dtype.type, list(x.shape), x.ctypes.data)
        self._session.run_with_iobinding(self._binding)
        return self.outputs
