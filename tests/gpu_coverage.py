"""Which GPU-tier test reaches each CUDA-only site of ``kernels/``, ``distattn/`` and ``launch/``.

A *site* is a function (``path:Class.function``, or ``path:<module>``) whose code names ``torch.cuda``, reads
``.is_cuda`` or compares something with the string ``"cuda"`` (``device.type == "cuda"``, ``device_type !=
"cuda"``...): the places where the code takes a branch only a CUDA device can take. ``cuda_sites()`` finds them
with ``ast``; ``tests/test_gpu_coverage.py`` fails when a site has no entry in ``COVERAGE`` (a new CUDA branch
needs a GPU-tier test), when an entry names no site (stale), or when an entry names a test that does not exist
or is not in the GPU tier (``@pytest.mark.gpu`` or a module ``pytestmark`` with it). Entries are
``"tests/FILE.py::test_name"``; a site may list several tests.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("kernels", "distattn", "launch")

_K = "tests/test_gpu_kernels.py::"
_D = "tests/test_gpu_dist.py::"
_M = "tests/test_gpu_model.py::"
_T = "tests/test_gpu_train.py::"

COVERAGE: dict[str, list[str]] = {
    "launch/train_plan.py:apply_auto": [_T + "test_train_memory_auto_plans_for_this_gpu"],
    "launch/train_plan.py:gpu_budget": [_T + "test_train_memory_auto_plans_for_this_gpu"],
    "distattn/memory/techniques.py:technique_peak": [_T + "test_step_peaks_predicted_and_measured_on_the_device_and_the_host"],
    "distattn/memory/tiers.py:_pinned": [_T + "test_step_peaks_predicted_and_measured_on_the_device_and_the_host"],
    "launch/train_memory.py:StepMeasure.__enter__": [_T + "test_step_peaks_predicted_and_measured_on_the_device_and_the_host"],
    "launch/train_memory.py:StepMeasure.__exit__": [_T + "test_step_peaks_predicted_and_measured_on_the_device_and_the_host"],
    "launch/train_memory.py:step_prediction": [_T + "test_step_peaks_predicted_and_measured_on_the_device_and_the_host"],
    "launch/train_memory.py:cublas_workspace_bytes": [_T + "test_step_peaks_predicted_and_measured_on_the_device_and_the_host"],
    "distattn/memory/cli.py:_gpu_mem": [_M + "test_planner_gpu_memory_defaults_to_what_this_gpu_reports"],
    "distattn/offload.py:CheckpointOffload.__init__": ["tests/test_offload.py::test_cuda_offload_same_gradients_pinned_host_and_freed_device", _T + "test_train_one_gpu_with_every_offload"],
    "distattn/offload.py:CheckpointOffload._copy_in": ["tests/test_offload.py::test_cuda_offload_same_gradients_pinned_host_and_freed_device", _T + "test_train_one_gpu_with_every_offload"],
    "distattn/offload.py:CheckpointOffload._fetch": ["tests/test_offload.py::test_cuda_offload_same_gradients_pinned_host_and_freed_device", _T + "test_train_one_gpu_with_every_offload"],
    "distattn/offload.py:CheckpointOffload._offload": ["tests/test_offload.py::test_cuda_offload_same_gradients_pinned_host_and_freed_device", _T + "test_train_one_gpu_with_every_offload"],
    "distattn/offload.py:CheckpointOffload._stream": ["tests/test_offload.py::test_cuda_offload_same_gradients_pinned_host_and_freed_device", _T + "test_train_one_gpu_with_every_offload"],
    "distattn/offload.py:pinned_memory_available": ["tests/test_offload.py::test_cuda_offload_same_gradients_pinned_host_and_freed_device", _T + "test_train_one_gpu_with_every_offload"],
    "launch/train_model.py:_fully_shard": [_T + "test_train_one_gpu_with_every_offload"],
    "launch/train_offload.py:check": [_T + "test_train_one_gpu_with_every_offload"],
    "distattn/api.py:validated_everywhere": [_D + "test_bad_input_on_one_rank_and_nan_rows_on_cuda"],
    # -- kernels: compiled Triton, descriptors, the CUDA sdpa ops, autotune ------------------------------------
    "kernels/__init__.py:available_backends": [_K + "test_sdpa_backend_on_cuda_by_rule"],
    "kernels/__init__.py:_default_backend": [_K + "test_triton_forward_backward_by_rule"],
    "kernels/_sdpa.py:_ops_for": [_K + "test_sdpa_backend_on_cuda_by_rule",
                                  "tests/test_sdpa.py::test_cuda_flash_ops_by_rule"],
    "kernels/_sdpa.py:is_available": [_K + "test_sdpa_backend_on_cuda_by_rule"],
    "kernels/_triton.py:is_available": [_K + "test_triton_forward_backward_by_rule"],
    "kernels/_triton.py:_max_shared_mem": [_K + "test_triton_forward_backward_by_rule"],
    "kernels/_triton.py:_tma_device_cached": [_K + "test_dkdv_descriptor_path_is_bit_identical_to_pointer_path"],
    "kernels/_triton.py:_scratch": [_K + "test_dkdv_descriptor_path_is_bit_identical_to_pointer_path"],
    "kernels/_triton.py:TritonBackend.backward_chunk_": [
        _K + "test_dkdv_descriptor_path_is_bit_identical_to_pointer_path", _K + "test_triton_masks_by_rule"],
    "kernels/_tune.py:_device": ["tests/test_tune.py::test_do_bench_tunes_on_cuda_and_the_launcher_uses_it",
                                 _T + "test_train_autotune_with_the_real_timer_and_its_cache"],
    "kernels/_tune.py:_tune_table": ["tests/test_tune.py::test_do_bench_tunes_on_cuda_and_the_launcher_uses_it"],
    "kernels/_tune.py:_device_name": [_T + "test_train_autotune_with_the_real_timer_and_its_cache"],
    # -- distattn: the op on CUDA tensors, streams, memory tools ------------------------------------------------
    "distattn/api.py:make_config": [_D + "test_dist_op_on_cuda_over_gloo_every_schedule_and_layout"],
    "distattn/comm.py:PeerExchange.__init__": [_D + "test_dist_op_on_cuda_over_gloo_every_schedule_and_layout",
                                               _D + "test_side_stream_orders_transfers_and_keeps_buffers"],
    "distattn/comm.py:PeerExchange.post": [_D + "test_side_stream_orders_transfers_and_keeps_buffers"],
    "distattn/comm.py:PeerExchange.wait": [_D + "test_side_stream_orders_transfers_and_keeps_buffers"],
    "distattn/ulysses.py:_Row.__init__": [_D + "test_dist_op_on_cuda_over_gloo_every_schedule_and_layout"],
    "distattn/integrations/_hf_data.py:bounded_all_reduce": [
        "tests/test_hf_trainer.py::test_trainer_collectives_on_cuda_over_gloo"],
    "distattn/compat/_relayout.py:_move": ["tests/test_compat_ring_flash_attn.py::test_moved_layouts_on_cuda_over_gloo"],
    "distattn/topology.py:_gather_int": [_D + "test_nccl_branches_gather_cuda_tensors"],
    "distattn/tune.py:_all_gather_json": [_D + "test_nccl_branches_gather_cuda_tensors"],
    "distattn/memory/measure.py:AllocatorDelta._stats": [_M + "test_allocator_delta_equals_saved_bytes_of_a_forward"],
    "distattn/memory/measure.py:AllocatorDelta.__enter__": [
        _M + "test_allocator_delta_equals_saved_bytes_of_a_forward"],
    "distattn/memory/measure.py:AllocatorDelta.__exit__": [
        _M + "test_allocator_delta_equals_saved_bytes_of_a_forward"],
    "distattn/memory/measure.py:warm_cuda_libraries": [_M + "test_allocator_delta_equals_saved_bytes_of_a_forward"],
    "distattn/memory/model.py:_device_dtypes": [_T + "test_planner_predicts_the_measured_peak"],
    # -- launch: the training job on CUDA ---------------------------------------------------------------------
    "launch/train_groups.py:init_distributed": [_T + "test_train_one_gpu", _T + "test_train_two_gloo_ranks_share_the_gpu"],
    "launch/train.py:train": [_T + "test_train_one_gpu"],
    "launch/train_config.py:RunConfig.cuda_index": [_T + "test_train_two_gloo_ranks_share_the_gpu"],
    "launch/train_config.py:RunConfig.ranks_per_gpu": [_T + "test_train_two_gloo_ranks_share_the_gpu"],
    "launch/train_config.py:_resolve_runtime": [_T + "test_train_one_gpu",
                                                _T + "test_train_two_gloo_ranks_share_the_gpu"],
    "launch/train_config.py:_resolve_attn_backend": [_T + "test_train_one_gpu"],
    "launch/train_log.py:peak_memory_bytes": [_T + "test_train_one_gpu",
                                              _T + "test_planner_predicts_the_measured_peak"],
    "launch/train_memory.py:check": [_T + "test_train_refuses_a_job_predicted_not_to_fit",
                                     _T + "test_planner_predicts_the_measured_peak"],
    "launch/train_model.py:_replicate": [_T + "test_train_one_gpu", _T + "test_train_two_gloo_ranks_share_the_gpu"],
    "launch/train_tune.py:autotune_attention": [_T + "test_train_autotune_with_the_real_timer_and_its_cache"],
}


def _is_cuda_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        if node.attr == "is_cuda":
            return True
        v = node.value
        return node.attr == "cuda" and isinstance(v, ast.Name) and v.id == "torch"
    if isinstance(node, ast.Compare):
        return any(isinstance(c, ast.Constant) and c.value == "cuda" for c in [node.left, *node.comparators])
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path, self.scope, self.sites = path, [], {}

    def _scoped(self, node):
        self.scope.append((isinstance(node, ast.ClassDef), node.name))
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def generic_visit(self, node):
        if _is_cuda_node(node):
            self.sites.setdefault(f"{self.path}:{self._name()}", getattr(node, "lineno", 0))
        super().generic_visit(node)

    def _name(self) -> str:
        """Classes down to the outermost function: a closure belongs to the function that defines it."""
        names = []
        for is_class, name in self.scope:
            names.append(name)
            if not is_class:
                break
        return ".".join(names) or "<module>"


def cuda_sites(root: Path = ROOT) -> dict[str, int]:
    """``{site: first line}`` of every CUDA-only site under ``SCANNED`` (see the module docstring)."""
    sites: dict[str, int] = {}
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            finder = _Finder(rel)
            finder.visit(ast.parse(path.read_text(), filename=rel))
            sites.update(finder.sites)
    return sites
