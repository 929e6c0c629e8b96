"""llmc's passes, one per module.

The registry is this explicit list: a new pass is a new module plus one line
here. ``llmc passes`` prints it.
"""

from llmc.passes.assume_kv_cache import AssumeKVCache
from llmc.passes.assume_shadow_plan import AssumeShadowPlan
from llmc.passes.calibrate import Calibrate
from llmc.passes.calibrate_ranges import CalibrateRanges
from llmc.passes.chunk_static_graphs import ChunkStaticGraphs
from llmc.passes.dce import DeadCodeElimination
from llmc.passes.extract_shadow_outliers import ExtractShadowOutliers
from llmc.passes.float16_kv_cache import Float16KVCache
from llmc.passes.fold_block_offsets import FoldBlockOffsets
from llmc.passes.fuse_cpu_decode import FuseCpuDecode
from llmc.passes.fuse_decode_graph import FuseDecodeGraph
from llmc.passes.fuse_sibling_linears import FuseSiblingLinears
from llmc.passes.place import Place
from llmc.passes.plan_offload import PlanOffload
from llmc.passes.quantize import Quantize
from llmc.passes.quantize_embedding import QuantizeEmbedding
from llmc.passes.quantize_int4 import QuantizeInt4
from llmc.passes.quantize_kv_cache import QuantizeKVCache
from llmc.passes.schedule import ScheduleSteps
from llmc.passes.select_logit_rows import SelectLogitRows
from llmc.passes.smooth_activations import SmoothActivations

ALL_PASSES = [DeadCodeElimination, Calibrate, SmoothActivations, QuantizeKVCache, Float16KVCache, ExtractShadowOutliers, Quantize, QuantizeInt4, FuseSiblingLinears, QuantizeEmbedding, FoldBlockOffsets, CalibrateRanges, SelectLogitRows, ChunkStaticGraphs, FuseCpuDecode, FuseDecodeGraph, Place, ScheduleSteps, PlanOffload,
              AssumeShadowPlan, AssumeKVCache]
REGISTRY = {p.name: p for p in ALL_PASSES}

# The pipeline each target runs when --pipeline is not given.
DEFAULT_PIPELINES = {
    "cpu": "dce,select_logit_rows,fuse_sibling_linears,chunk_static_graphs,fuse_decode_graph,place,schedule,plan_offload",
    # --target cpu --weights int4
    "cpu-int4": "dce,select_logit_rows,quantize_int4,fuse_sibling_linears,fold_block_offsets,chunk_static_graphs,fuse_decode_graph,place,schedule,plan_offload",
    "npu": "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,fuse_sibling_linears,quantize_embedding,chunk_static_graphs,fuse_cpu_decode,fuse_decode_graph,place,schedule,plan_offload",
    "mlir": "dce,select_logit_rows,fuse_sibling_linears,chunk_static_graphs,fuse_decode_graph,place,schedule,plan_offload",
    # `llmc plan`: no weights, so no calibration; the program has the npu target's shape
    "plan-npu": "dce,select_logit_rows,assume_shadow_plan,quantize,fuse_sibling_linears,quantize_embedding,chunk_static_graphs,fuse_cpu_decode,fuse_decode_graph,place,schedule,plan_offload",
    "plan-cpu": "dce,select_logit_rows,fuse_sibling_linears,chunk_static_graphs,fuse_decode_graph,place,schedule,plan_offload",
    "plan-cpu-int4": "dce,select_logit_rows,quantize_int4,fuse_sibling_linears,fold_block_offsets,chunk_static_graphs,fuse_decode_graph,place,schedule,plan_offload",
    # --target npu --soc S: every NPU tensor gets a QDQ range for the HTP
    "npu-qnn": "dce,select_logit_rows,calibrate,extract_shadow_outliers,quantize,fuse_sibling_linears,quantize_embedding,calibrate_ranges,chunk_static_graphs,fuse_cpu_decode,fuse_decode_graph,place,schedule,plan_offload",
}

# What runs each of them (`llmc passes` prints it).
PIPELINE_USES = {
    "cpu": "llmc compile --target cpu",
    "cpu-int4": "llmc compile --target cpu --weights int4",
    "npu": "llmc compile --target npu",
    "mlir": "llmc compile --target mlir",
    "plan-npu": "llmc plan --target npu",
    "plan-cpu": "llmc plan --target cpu",
    "plan-cpu-int4": "llmc plan --target cpu --weights int4",
    "npu-qnn": "llmc compile --target npu --soc SOC",
}
