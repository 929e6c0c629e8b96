"""``llmc plan``: predict a model's speed and memory on a device from its config alone.

The model is built on PyTorch's meta device (shapes, no storage), traced and
lifted like a compile, and run through the planning pipeline (``plan-npu``:
the npu target's quantized program shape with an assumed shadow plan and the
CPU's program (``fuse_cpu_decode``), then ``place``, ``schedule`` and
``plan_offload``). Nothing is downloaded and no
weight is read, so a 7B model plans in seconds on a laptop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from llmc.analyses import ChunkPlan, OffloadPlan, Placement, Schedule
from llmc.errors import ModelLoadError
from llmc.ops import kv_cache_itemsize
from llmc.pass_manager import CompileOptions, ModelInputs, PassContext, format_pipeline, parse_pipeline, run_pipeline

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "model_configs"


def known_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(source: str):
    """A transformers config from a shipped config name, a bundled model, a config.json or a model directory."""
    import transformers

    from llmc import model_source

    transformers.utils.logging.disable_progress_bar()
    p = Path(source).expanduser()
    try:
        if (CONFIG_DIR / f"{source}.json").is_file():
            data = json.loads((CONFIG_DIR / f"{source}.json").read_text())
            return _from_dict(data), f"config {source} (shipped: {data.get('_llmc_source', '')})"
        if source in model_source.BUNDLED:
            path = model_source.bundled_model_path(source)
            return transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True), f"bundled {source}"
        if p.suffix == ".json" and p.is_file():
            return _from_dict(json.loads(p.read_text())), f"config file {p}"
        if p.suffix == ".gguf" and p.is_file():
            return transformers.AutoConfig.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True), f"GGUF file {p}"
        if p.is_dir() and (p / "config.json").is_file():
            return transformers.AutoConfig.from_pretrained(p, local_files_only=True), f"model directory {p}"
    except ModelLoadError:
        raise
    except Exception as e:
        err = model_source.config_error(f"cannot read the config of {source}", e, gguf=p.suffix == ".gguf")
        if err is None:
            raise
        raise err from e
    raise ModelLoadError(f"no model config found for {source!r}",
                         hint="pass a config.json, a model directory, a .gguf file, smollm2-135m, or one of: " + ", ".join(known_configs()))


def _from_dict(data: dict[str, Any]):
    import transformers

    if not isinstance(data, dict):
        raise ModelLoadError(f"the config is a JSON {type(data).__name__}, not an object", hint="pass a model's config.json")
    data = {k: v for k, v in data.items() if not k.startswith("_llmc")}
    mt = data.get("model_type")
    if not mt:
        raise ModelLoadError("the config has no model_type")
    return transformers.AutoConfig.for_model(**data)


def meta_model(config):
    """The model of ``config`` with meta tensors: every shape, no storage."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@dataclasses.dataclass
class PlanResult:
    model: str
    description: str
    profile: str
    target: str
    chunk: int
    prompt_len: int
    pipeline: str
    placement: Placement
    schedule: Schedule
    offload: OffloadPlan | None
    weight_bytes: int  # what the deployed program reads: int8 matrices, vectors, tables
    kv_cache_bytes: int  # K and V for the prompt (float32, or int8 / float16 with --kv-cache)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_len / self.schedule.prefill_s

    @property
    def decode_tok_s(self) -> float:
        t = self.offload.predicted_decode_s if self.offload else self.schedule.decode_s
        return 1.0 / t

    def as_dict(self) -> dict[str, Any]:
        s = self.schedule
        pl = self.placement
        d: dict[str, Any] = {
            "model": self.model, "source": self.description, "profile": self.profile, "target": self.target, "chunk": self.chunk,
            "prompt_len": self.prompt_len, "pipeline": self.pipeline,
            "prefill": {
                "latency_s": s.prefill_s, "tok_s": self.prefill_tok_s,
                "in_order_s": s.in_order.makespan_s + s.head_s, "out_of_order_s": s.out_of_order.makespan_s + s.head_s,
                "npu_bubble_rate_in_order": s.in_order.npu_bubble_rate, "npu_bubble_rate_out_of_order": s.out_of_order.npu_bubble_rate,
                "npu_busy_s": s.chosen.npu_busy_s, "cpu_busy_s": s.chosen.cpu_busy_s,
                "policy": {"graph": "chunk graph", "cpu": "cpu program"}.get(s.prefill_program, s.chosen.policy),
            },
            "decode": {"s_per_token": 1.0 / self.decode_tok_s, "tok_s": self.decode_tok_s},
            "placement": {ph: {"npu": sum(1 for p in getattr(pl, ph).values() if p == "npu"), "cpu": sum(1 for p in getattr(pl, ph).values() if p == "cpu")}
                          for ph in ("prefill", "decode")},
            "memory": {"weight_bytes": self.weight_bytes, "kv_cache_bytes": self.kv_cache_bytes},
        }
        if self.offload is not None:
            o = self.offload
            d["offload"] = {"budget_bytes": o.budget_bytes, "resident_bytes": o.resident_bytes, "streamed_bytes_per_token": o.streamed_bytes,
                            "buffer_bytes": o.buffer_bytes, "prefetch_depth": o.prefetch_depth,
                            "resident_shadow_rows": sum(len(r) for r in o.resident_rows.values()),
                            "decode_tok_s_prefetch": 1.0 / o.predicted_decode_s, "decode_tok_s_no_prefetch": 1.0 / o.predicted_decode_no_prefetch_s}
        return d


def planned_program(source: str, options: CompileOptions, pipeline: str | None = None):
    """Build ``source`` on the meta device, lift it and run the planning pipeline.

    Returns ``(graph, ctx, description, pipeline)``; the analyses (ChunkPlan,
    Placement, Schedule, OffloadPlan) are in ``ctx``.
    """
    from llmc import lift as lift_mod
    from llmc import model_source
    from llmc.device_profile import load as load_profile
    from llmc.passes import DEFAULT_PIPELINES, REGISTRY

    load_profile(options.profile)  # fail before the slow part
    passes = parse_pipeline(pipeline or DEFAULT_PIPELINES[f"plan-{options.target}"], REGISTRY)
    config, description = load_config(source)
    model_source.check_config(config, source)
    model = meta_model(config)
    ep = lift_mod.trace(model, options.chunk)
    graph = lift_mod.lift(ep, model, name=type(model).__name__)
    del ep
    ctx = PassContext(options, ModelInputs(None, f"plan:{source}"))
    run_pipeline(graph, passes, ctx)
    return graph, ctx, description, format_pipeline(passes)


def plan_model(source: str, *, profile: str, prompt_len: int, target: str = "npu", chunk: int = 256, max_context: int | None = None,
               memory_budget: str | None = None, prefetch_depth: int = 2, pipeline: str | None = None,
               shadow: bool = True, shadow_keep: float = 1.0, weight_format: str = "float32", kv_cache: str = "float32",
               weight_bits: int = 8) -> PlanResult:
    from llmc.compile import check_float16_kv_cache, check_kv_cache_format, resolve_kv_cache, with_float16_kv_cache, with_kv_cache
    from llmc.errors import CompileError
    from llmc.passes import DEFAULT_PIPELINES
    from llmc.passes.quantize_int4 import check_weight_format

    from llmc.units import parse_size

    if prompt_len < 1:
        raise CompileError(f"--prompt-len must be at least 1, is {prompt_len}")
    if memory_budget is not None:
        parse_size(memory_budget, total=1)  # the syntax, before the slow part; a percentage's base is known later
    if target not in ("npu", "cpu"):
        raise CompileError(f"llmc plan supports --target npu or cpu, not {target!r}")
    if weight_format == "int4" and pipeline is None:
        pipeline = DEFAULT_PIPELINES["plan-cpu-int4"]
    check_weight_format(weight_format, target, (pipeline or DEFAULT_PIPELINES[f"plan-{target}"]).split(","))
    check_kv_cache_format(kv_cache)
    kv_cache = resolve_kv_cache(kv_cache, target, "onnx", pipeline, memory_budget)  # plan models stock kernels (float16: native), so auto is float32
    from llmc.passes.quantize import check_weight_bits

    check_weight_bits(weight_bits)
    if weight_bits != 8 and target != "npu":
        raise CompileError(f"--weight-bits {weight_bits} applies to --target npu (its W8A8 weights), not {target}")
    if kv_cache == "int8":
        pipeline = ",".join(with_kv_cache((pipeline or DEFAULT_PIPELINES[f"plan-{target}"]).split(","), assume=True))
    elif kv_cache == "float16":  # as compile --kv-cache float16 --cpu-kernels native: the decode graph's native attention
        check_float16_kv_cache("native", memory_budget)
        pipeline = ",".join(with_float16_kv_cache((pipeline or DEFAULT_PIPELINES[f"plan-{target}"]).split(",")))
    max_context = max_context or chunk * math.ceil(prompt_len / chunk)
    if prompt_len > max_context:
        raise CompileError(f"--prompt-len {prompt_len} exceeds --max-context {max_context}")
    options = CompileOptions(target=target, chunk=chunk, max_context=max_context, profile=profile, prompt_len=prompt_len,
                             memory_budget=memory_budget, prefetch_depth=prefetch_depth, shadow=shadow, shadow_keep=shadow_keep,
                             weight_bits=weight_bits, cpu_kernels="native" if kv_cache == "float16" else "onnx")
    graph, ctx, description, pipeline_text = planned_program(source, options, pipeline)
    plan = ctx.get(ChunkPlan)
    used: set[str] = set()
    for s in plan.subgraphs:
        used.update(s.weights)
    for st in plan.steps:
        if st.kind == "op":
            node = graph.node(st.name)  # (the codes a correction reads by row are the projections' own)
            used.update(r.name for slot, r in node.weights.items() if not (node.op == "ShadowOutliers" and slot == "codes"))
    weight_bytes = sum(graph.weights[w].nbytes for w in used)
    kv = sum(2 * prompt_len * n.attrs["num_kv_heads"] * n.attrs["head_dim"] * kv_cache_itemsize(n) for n in graph.find("Attention"))
    return PlanResult(source, description, profile, target, chunk, prompt_len, pipeline_text,
                      ctx.get(Placement), ctx.get(Schedule), ctx.get(OffloadPlan) if ctx.has(OffloadPlan) else None, weight_bytes, kv)
