"""The slow tier: tests marked ``slow`` by ``conftest.py`` (``pytest -m "not slow"`` is the fast tier, README).

Measured with ``--durations=0`` over the full suite on the 2-core machine under load (several sessions sharing it)
and with coverage on (bench/results/fast-tier/README.md): every test whose setup + call + teardown took over 4 s
there; then the tests over 6 s in the fast tier's own run, to bring it under 5 minutes on a quiet machine. A test
file whose every test was over keeps its cheapest one in the fast tier, except where the package modules it reaches
are reached by other fast tests (``test_plan_cpu_bench.py`` measures bench/ only): the per-module line coverage of
both tiers is in bench/results/fast-tier/README.md. Ids are exact (``file::test[params]``); a listed id that no longer names a
test fails the full suite (:func:`stale`, checked by ``test_slow_tier.py``). Seconds are that run's, for reading, not
thresholds. Tests whose ids move with other files (the README's snippets) are marked where they are parametrized.
"""

SLOW = {
    'tests/test_auto.py::test_auto_at_call_time_matches_the_reference_and_picks_a_contiguous_schedule': 59.7,
    'tests/test_baselines.py::test_baselines_match_reference[2]': 27.6,
    'tests/test_baselines.py::test_baselines_match_reference[3]': 34.1,
    'tests/test_baselines.py::test_baselines_match_reference[4]': 24.2,
    'tests/test_checkpoint.py::test_op_equals_dist_flash_attn_func[1]': 38.1,
    'tests/test_compat.py::test_library_groups_number_ranks_as_the_users_group_on_either_torch': 6.5,
    'tests/test_compat_hf_adapter.py::test_loaded_with_the_adapter_name_matches_sdpa_and_eager': 9.4,
    'tests/test_compat_ring_flash_attn.py::test_every_function_matches_the_reference[3]': 10.9,
    'tests/test_compat_ring_flash_attn.py::test_every_function_matches_the_reference[4]': 5.8,
    'tests/test_compat_ring_flash_attn.py::test_hf_adapter_matches_one_process': 4.2,
    'tests/test_compile_report.py::test_pointer_path_64bit_offsets': 50.6,
    'tests/test_compile_report.py::test_quick_report_no_spills_64bit_offsets': 95.7,
    'tests/test_dist_attention.py::test_grid_against_reference[1]': 14.0,
    'tests/test_dist_attention.py::test_grid_against_reference[2]': 25.0,
    'tests/test_dist_attention.py::test_grid_against_reference[3]': 29.6,
    'tests/test_dist_attention.py::test_grid_against_reference[4]': 34.3,
    'tests/test_dist_attention.py::test_grid_against_reference[5]': 62.0,
    'tests/test_dist_attention.py::test_grid_against_reference[8]': 65.5,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[2]': 5.5,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[3]': 9.2,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[4]': 16.2,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[5]': 4.3,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[6]': 9.5,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[7]': 6.7,
    'tests/test_dist_layouts.py::test_zigzag_shard_gather_round_trip_and_gradient[8]': 9.6,
    'tests/test_dist_placed.py::test_matched_orders_against_reference[4-ranks-work]': 4.5,
    'tests/test_dist_placed.py::test_placed_documents_against_reference[8]': 5.2,
    'tests/test_dist_placed_window.py::test_windowed_placed_call_against_reference[2]': 7.4,
    'tests/test_dist_placed_window.py::test_windowed_placed_call_against_reference[3]': 25.5,
    'tests/test_dist_utils.py::test_timed_out_ranks_are_named_with_the_others_errors': 20.1,
    'tests/test_dist_varlen.py::test_packed_documents_against_reference[2]': 5.5,
    'tests/test_dist_varlen.py::test_packed_documents_against_reference[3]': 8.8,
    'tests/test_dist_varlen.py::test_packed_documents_against_reference[4]': 21.0,
    'tests/test_dist_varlen.py::test_packed_documents_against_reference[5]': 29.1,
    'tests/test_dist_varlen.py::test_packed_documents_against_reference[8]': 7.8,
    'tests/test_dist_varlen.py::test_short_document_with_tail_padding_matches_reference_and_local_cu_seqlens_raise[2]':
        65.7,
    'tests/test_dist_varlen.py::test_short_document_with_tail_padding_matches_reference_and_local_cu_seqlens_raise[3]':
        6.6,
    'tests/test_executor_memory.py::test_executor_buffers_equal_the_replay[2]': 12.6,
    'tests/test_executor_memory.py::test_executor_buffers_equal_the_replay[4]': 28.2,
    'tests/test_export_hf.py::test_cli_converts_and_refuses_a_non_empty_folder': 57.8,
    'tests/test_export_hf.py::test_export_and_converter_give_the_checkpoint_bit_for_bit[two-2-2]': 98.5,
    'tests/test_export_hf.py::test_non_empty_export_folder_stops_every_rank_before_step_1': 19.1,
    'tests/test_faults.py::test_communicators_are_freed_with_their_group': 5.9,
    'tests/test_flash_attn_func.py::test_lengths[torch.float16-100-100-True-None]': 4.7,
    'tests/test_flash_attn_func.py::test_lengths[torch.float16-257-257-False-None]': 6.4,
    'tests/test_flash_attn_func.py::test_lengths[torch.float16-257-257-False-torch]': 9.4,
    'tests/test_flash_attn_func.py::test_lengths[torch.float16-257-257-True-None]': 6.1,
    'tests/test_flash_attn_func.py::test_lengths[torch.float16-257-257-True-torch]': 5.5,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-17-100-False-torch]': 5.5,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-17-100-True-None]': 6.0,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-17-100-True-torch]': 5.6,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-257-257-False-None]': 4.3,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-257-257-False-torch]': 6.2,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-257-257-True-None]': 7.8,
    'tests/test_flash_attn_func.py::test_lengths[torch.float32-257-257-True-torch]': 9.1,
    'tests/test_gpu_check.py::test_dry_run_writes_every_file_and_every_part_passes': 88.9,
    'tests/test_gpu_coverage.py::test_every_cuda_site_has_a_gpu_test_and_no_entry_is_stale': 5.2,
    'tests/test_gradients.py::test_every_rank_steps_on_the_full_sequence_gradient[2-plain-one batch]': 10.6,
    'tests/test_head_groups.py::test_four_groups_hold_at_most_a_quarter_and_a_bit_and_the_byte_model_counts_them[2]':
        6.4,
    'tests/test_head_groups.py::test_four_groups_hold_at_most_a_quarter_and_a_bit_and_the_byte_model_counts_them[4]':
        16.1,
    'tests/test_hf.py::test_loss_and_gradients_match_single_process_eager[1-llama-none]': 12.9,
    'tests/test_hf_compile.py::test_no_graph_break_and_no_recompile_per_step': 255.9,
    'tests/test_hf_moe.py::test_moe_trainer_matches_one_process[2-qwen3 dense]': 31.8,
    'tests/test_hf_trainer.py::test_trainer_matches_one_process[2-dense-dense]': 56.9,
    'tests/test_masked_scale.py::test_a_memory_limit_gives_one_clear_error_not_a_traceback': 24.9,
    'tests/test_masked_scale.py::test_large_document_plans_in_bounded_memory_and_time': 55.7,
    'tests/test_masked_scale.py::test_masked_plans_are_the_plans_built_before': 16.5,
    'tests/test_masked_scale.py::test_sparse_pairs_equal_the_row_by_row_computation': 14.7,
    'tests/test_masks.py::test_flash_attn_func_window_softcap[q<k-softcap-full-triton-float32]': 7.4,
    'tests/test_masks.py::test_flash_attn_func_window_softcap[q>k-win4-0-causal-triton-float32]': 4.2,
    'tests/test_masks.py::test_fold_and_backward_chunks_with_bounds[dense-window-q<k-triton]': 10.3,
    'tests/test_masks.py::test_fold_and_backward_chunks_with_bounds[varlen-full-win-softcap-triton]': 16.6,
    'tests/test_masks.py::test_fold_and_backward_chunks_with_bounds[varlen-rows-subset-triton]': 11.5,
    'tests/test_masks.py::test_fold_and_backward_chunks_with_bounds[varlen-sq!=sk-causal-win-triton]': 14.2,
    'tests/test_memory.py::test_llama_layer_matches_model_exactly[h48a3kv3]': 13.4,
    'tests/test_memory.py::test_llama_layer_matches_model_exactly[h64a4kv2]': 11.1,
    'tests/test_memory.py::test_llama_layer_matches_model_exactly[h64a8kv1]': 10.4,
    'tests/test_memory.py::test_plan_cli_table_and_plot': 9.9,
    'tests/test_memory_auto.py::test_nothing_fits_fails_on_every_rank_before_step_1': 24.0,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[2]': 7.4,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[3]': 13.4,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[4]': 15.0,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[5]': 20.4,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[6]': 31.1,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[7]': 60.1,
    'tests/test_nonfinite.py::test_gradient_nan_inf_masks_equal_one_device[8]': 38.2,
    'tests/test_nonfinite.py::test_nan_and_inf_come_out_where_one_device_puts_them[3]': 4.1,
    'tests/test_nonfinite.py::test_nan_and_inf_come_out_where_one_device_puts_them[4]': 6.7,
    'tests/test_offload.py::test_blocks_offloaded_gradients_are_bit_identical[remat-1]': 20.1,
    'tests/test_peers_train_step.py::test_alst_step_equals_reference_and_offloads': 6.2,
    'tests/test_peers_train_step.py::test_distattn_step_equals_reference_and_offloads': 8.1,
    'tests/test_plan_cpu_bench.py::test_side_by_side_fills_both_columns': 23.4,
    'tests/test_plan_techniques.py::test_plan_cli_bad_input[argv2-no combination fits]': 5.5,
    'tests/test_plan_techniques.py::test_plan_cli_prints_every_combination_and_auto': 5.7,
    'tests/test_plan_techniques.py::test_planner_headline_is_the_readme_table[llama-7b-16-a100-40gb]': 12.4,
    'tests/test_plan_techniques.py::test_planner_headline_is_the_readme_table[llama3-8b-32-h100]': 21.5,
    'tests/test_plan_techniques.py::test_planner_headline_is_the_readme_table[llama3-8b-8-h100]': 4.5,
    'tests/test_plots.py::test_scaling_plots_fixed_colours_one_legend': 5.1,
    'tests/test_recovery.py::test_the_readme_loop_after_a_death_only_errs_within_seconds[2-backward]': 9.5,
    'tests/test_recovery.py::test_the_readme_loop_after_a_death_only_errs_within_seconds[2-forward]': 8.4,
    'tests/test_recovery.py::test_the_readme_loop_after_a_death_only_errs_within_seconds[3-backward]': 13.4,
    'tests/test_recovery.py::test_the_readme_loop_after_a_death_only_errs_within_seconds[3-forward]': 11.4,
    'tests/test_recovery.py::test_the_readme_loop_after_a_death_only_errs_within_seconds[4-backward]': 15.1,
    'tests/test_recovery.py::test_the_readme_loop_after_a_death_only_errs_within_seconds[4-forward]': 15.5,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[2-retry]': 20.2,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[2-skip-nostep]':
        311.0,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[2-skip]': 21.9,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[3-retry-nostep]':
        27.2,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[3-retry]': 21.0,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[3-skip]': 20.9,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[4-retry]': 21.7,
    'tests/test_recovery.py::test_the_readme_loop_through_stalls_is_exact_or_an_error_and_ends_in_step[4-skip]': 20.5,
    'tests/test_reliability.py::test_disagreements_faults_and_skips_fail_fast_and_recover[2]': 30.6,
    'tests/test_reliability.py::test_disagreements_faults_and_skips_fail_fast_and_recover[4]': 38.3,
    'tests/test_scaling_smoke.py::test_scaling_smoke_writes_table': 96.6,
    'tests/test_schedule.py::test_every_pair_once_one_task_per_rank_per_step[balanced-False]': 9.2,
    'tests/test_schedule.py::test_every_pair_once_one_task_per_rank_per_step[balanced-True]': 7.4,
    'tests/test_schedule.py::test_every_pair_once_one_task_per_rank_per_step[ring-False]': 10.2,
    'tests/test_schedule.py::test_every_pair_once_one_task_per_rank_per_step[ring-True]': 10.7,
    'tests/test_schedule.py::test_every_pair_once_one_task_per_rank_per_step[zigzag-True]': 11.4,
    'tests/test_schedule.py::test_fetches_and_returns_match_tasks[backward]': 72.6,
    'tests/test_schedule.py::test_fetches_and_returns_match_tasks[forward]': 66.3,
    'tests/test_tiling.py::test_distributed_hf_llama_tiled_matches_untiled[none-2]': 14.2,
    'tests/test_timeline.py::test_the_executor_runs_the_timelines_event_order[3]': 5.4,
    'tests/test_timeline.py::test_the_executor_runs_the_timelines_event_order[4]': 9.1,
    'tests/test_train.py::test_crash_then_resume_reproduces_the_losses': 169.0,
    'tests/test_train.py::test_data_parallel_replicas_step_as_one_batch[ddp]': 84.2,
    'tests/test_train.py::test_data_parallel_replicas_step_as_one_batch[fsdp]': 88.5,
    'tests/test_train.py::test_pack_trains_on_documents_and_reports_what_masking_skipped': 83.1,
    'tests/test_train.py::test_tiled_loss_and_mlp_give_the_same_losses': 94.0,
    'tests/test_train.py::test_torchrun_max_restarts_resumes': 163.5,
    'tests/test_train.py::test_two_ranks_train_and_loss_falls': 72.6,
    'tests/test_train.py::test_world_one_gives_the_same_losses': 64.5,
    'tests/test_train.py::test_zigzag_and_ulysses_give_the_same_losses': 92.1,
    'tests/test_triton.py::test_backward_is_deterministic': 114.4,
    'tests/test_triton.py::test_dkdv_descriptor_path_is_bit_identical_to_pointer_path[q33-k33-h6:3-d80-full]': 34.8,
    'tests/test_triton.py::test_dkdv_descriptor_path_is_bit_identical_to_pointer_path[q45-k70-h8:2-d32-causal]': 106.8,
    'tests/test_triton.py::test_dkdv_descriptor_path_is_bit_identical_to_pointer_path[q50-k50-h2:1-d16-softcap]': 18.0,
    'tests/test_triton.py::test_dkdv_descriptor_path_is_bit_identical_to_pointer_path[q61-k61-h4:2-d16-docs]': 26.7,
    'tests/test_triton.py::test_dkdv_descriptor_path_is_bit_identical_to_pointer_path[q64-k64-h4:1-d16-causal]': 24.9,
    'tests/test_triton.py::test_dkdv_descriptor_path_needs_aligned_inputs': 23.6,
    'tests/test_triton.py::test_fold_in_chunks_equals_one_call[1-fwd]': 42.7,
    'tests/test_triton.py::test_fold_in_chunks_equals_one_call[2-fwd]': 83.2,
    'tests/test_triton.py::test_fold_in_chunks_equals_one_call[3-fwd]': 107.7,
    'tests/test_triton.py::test_fold_in_chunks_equals_one_call[3-rev]': 59.0,
    'tests/test_triton.py::test_fold_in_chunks_equals_one_call[7-fwd]': 131.3,
    'tests/test_triton.py::test_fold_in_chunks_equals_one_call[7-rev]': 87.0,
    'tests/test_triton.py::test_forward_backward_against_fp64[b1-q17-k100-h2:2-d96-causal-float16-ptr]': 25.4,
    'tests/test_triton.py::test_forward_backward_against_fp64[b1-q257-k257-h1:1-d128-full-float16-ptr]': 155.6,
    'tests/test_triton.py::test_forward_backward_against_fp64[b2-q17-k17-h4:1-d64-causal-float16-ptr]': 23.7,
    'tests/test_triton.py::test_merge_of_partial_from_second_state_equals_one_call[False]': 43.3,
    'tests/test_triton.py::test_merge_of_partial_from_second_state_equals_one_call[True]': 41.8,
    'tests/test_triton.py::test_rows_that_see_no_key': 10.4,
    # Files the full run did not reach: measured in the loaded fast-tier run, seconds divided by 5.3 (the slowdown of
    # the same tests between the two runs).
    'tests/test_compile_cold.py::test_llama3_family_compiles_fullgraph_and_matches_eager': 11.9,
    'tests/test_hf_trainer_techniques.py::test_technique_matches_one_process[tile_loss]': 10.0,
    'tests/test_hf_trainer_fsdp2.py::test_the_byte_model_holds_the_trainers_fsdp2_step': 20.0,
    'tests/test_hf_trainer_fsdp2.py::test_fsdp2_under_the_trainer_matches_one_process[fsdp2]': 17.0,
    'tests/test_hf_trainer_fsdp2.py::test_fsdp2_under_the_trainer_matches_one_process[fsdp2 + optimizer offload]': 17.0,
    'tests/test_hf_trainer_fsdp2.py::test_fsdp2_under_the_trainer_matches_one_process[fsdp2 + optimizer offload + every technique]': 17.0,
    'tests/test_hf_trainer_fsdp2.py::test_the_cpu_patch_is_accelerates_fsdp2[fsdp2]': 17.0,
    'tests/test_hf_trainer_fsdp2.py::test_the_cpu_patch_is_accelerates_fsdp2[fsdp2 + optimizer offload]': 17.0,
    'tests/test_hf_trainer_fsdp2.py::test_the_cpu_patch_is_accelerates_fsdp2[fsdp2 + optimizer offload + every technique]': 17.0,
    'tests/test_step_memory.py::test_train_json_summary_reports_predicted_and_measured_peaks': 10.1,
    'tests/test_tiling.py::test_hf_llama_tiled_matches_untiled_one_process[hf-reentrant-False]': 5.3,
    'tests/test_train_ckpt.py::test_crafted_checkpoints_end_to_end': 6.4,
    'tests/test_train_ckpt.py::test_damaged_newest_is_skipped_and_resume_is_bit_identical': 4.8,
    'tests/test_train_ckpt.py::test_layout_and_manifest': 7.0,
    'tests/test_train_ckpt.py::test_refusals_after_init_are_one_line_and_exit_2': 5.7,
    'tests/test_train_ckpt_contents.py::test_a_real_progress_passes_and_records_where_its_layout_began': 4.7,
    'tests/test_train_ckpt_contents.py::test_crafted_contents_stop_every_rank_before_step_1': 11.9,
    'tests/test_train_cli.py::test_help_prints_once': 8.6,
    'tests/test_train_cli.py::test_preflight_errors_are_one_line_and_exit_2': 10.1,
    'tests/test_train_data_formats.py::test_bad_data_stops_train_py_before_step_one': 4.8,
    # Over 6 s in the fast tier's own run (2026-11-28, -n 2, five other jobs on the machine: about 1.5-2x a quiet
    # machine), moved here to bring the fast tier under 5 minutes on a quiet 2-core machine.
    'tests/test_checkpoint.py::test_op_equals_dist_flash_attn_func[2]': 11.5,
    'tests/test_dist_layouts.py::test_zigzag_against_reference[4]': 7.8,
    'tests/test_export_hf.py::test_cli_read_errors_are_one_line': 20.5,
    'tests/test_export_hf.py::test_export_and_converter_give_the_checkpoint_bit_for_bit[one-3-1]': 20.9,
    'tests/test_faults.py::test_one_rank_failing_validation_fails_every_rank_alike_and_the_next_call_is_exact[2]': 8.7,
    'tests/test_gradients.py::test_every_rank_steps_on_the_full_sequence_gradient[2-ddp-one batch]': 6.6,
    'tests/test_hf.py::test_loss_and_gradients_match_single_process_eager[1-llama-hf]': 6.5,
    'tests/test_hf_compile.py::test_compiled_loss_and_gradients_match_eager': 63.2,
    'tests/test_hf_moe.py::test_moe_trainer_matches_one_process[2-mixtral flattened]': 25.0,
    'tests/test_hf_packed.py::test_packed_batch_equals_each_document_alone[2-llama]': 10.7,
    'tests/test_hf_packed.py::test_packed_batch_equals_each_document_alone[2-mistral]': 10.6,
    'tests/test_hf_placed_window.py::test_packed_batch_placed_for_the_window_equals_each_document_alone': 13.4,
    'tests/test_hf_trainer.py::test_trainer_matches_one_process[2-flattened-flattened]': 6.7,
    'tests/test_hf_trainer_techniques.py::test_technique_matches_one_process[tile_mlp]': 38.7,
    'tests/test_offload.py::test_blocks_offloaded_gradients_are_bit_identical[remat-2]': 13.6,
    'tests/test_peers.py::test_hang_and_raise_give_error_rows_within_the_deadline': 9.4,
    'tests/test_peers_train_step.py::test_alst_head_grad_patch_still_needed': 9.5,
    'tests/test_plan_cpu_bench.py::test_the_table_has_a_row_per_schedule_and_size': 50.6,
    'tests/test_sim_scale.py::test_simulator_and_cost_model_equal_the_reference_on_small_plans': 11.6,
    'tests/test_step_memory.py::test_one_rank_step_equals_the_byte_model': 9.2,
    'tests/test_step_memory.py::test_fsdp2_step_equals_the_byte_model[balanced]': 6.4,
    'tests/test_step_memory.py::test_fsdp2_step_equals_the_byte_model[remat-all-placed]': 8.0,
    'tests/test_step_memory.py::test_fsdp2_step_equals_the_byte_model[P4]': 20.0,
    'tests/test_tiling.py::test_hf_llama_tiled_matches_untiled_one_process[none-False]': 9.8,
    'tests/test_tiling.py::test_hf_llama_tiled_matches_untiled_one_process[none-True]': 9.8,
    'tests/test_train_ckpt.py::test_real_metadata_needs_only_the_allow_list': 12.6,
    'tests/test_train_ckpt_contents.py::test_bad_progress_is_refused_naming_the_field[{"samples": -7}]': 13.8,
    'tests/test_train_data_formats.py::test_two_ranks_train_on_jsonl_and_log_held_out_loss': 20.4,
    'tests/test_train_lock.py::test_second_job_stops_at_once_and_a_killed_jobs_lock_is_taken_over': 34.3,
    'tests/test_train_offload.py::test_offloaded_runs_give_the_same_losses[offload-full]': 54.8,
    'tests/test_train_offload.py::test_too_little_host_memory_fails_on_every_rank_before_step_1': 9.7,
    'tests/test_train_placed.py::test_placed_follows_the_contiguous_loss_curve': 49.6,
    'tests/test_triton.py::test_forward_backward_against_fp64[b1-q17-k17-h33:3-d16-full-float32-desc]': 7.6,
    'tests/test_triton.py::test_forward_backward_against_fp64[b1-q257-k100-h2:1-d64-full-float32-desc]': 8.2,
    'tests/test_triton.py::test_forward_backward_against_fp64[b1-q257-k257-h1:1-d128-full-float16-desc]': 7.5,
    'tests/test_triton.py::test_forward_backward_against_fp64[b2-q100-k100-h8:2-d16-causal-float16-desc]': 9.1,
    'tests/test_varlen.py::test_varlen_against_explicit_mask[docs-1-2-17-100-causal-triton-float32]': 9.9,
    'tests/test_varlen.py::test_varlen_against_explicit_mask[docs-100-17-2-1-full-d80-triton-float16]': 16.6,
    # Added after the fast tier's measurement (47ff67c), spawned runs of 4 ranks / a Trainer pair:
    'tests/test_torchtitan.py::test_converted_models_match_one_process[P4-replicas]': 48.4,
    'tests/test_hf_trainer_batch_keys.py::test_flattening_boundaries_are_passed_as_one_process_passes_them': 11.2,
    'tests/test_hf_trainer_batch_keys.py::test_a_key_the_model_would_lose_is_refused_on_every_rank_before_the_first_step': 1.0,
    # megatron-core beside the peers (issue 37): 2 spawned ranks that import megatron-core each (2026-11-28, loaded)
    'tests/test_peers.py::test_adapter_exact_at_p2[megatron-core-causal]': 10.1,
    'tests/test_peers.py::test_adapter_exact_at_p2[megatron-core-docs]': 11.1,
    'tests/test_peers.py::test_megatron_core_refusals_are_rows_with_its_own_words': 16.5,
    'tests/test_baselines_real.py::test_home_made_megatron_against_megatron_core[2]': 19.0,
    'tests/test_baselines_real.py::test_home_made_megatron_against_megatron_core[4]': 22.5,
    'tests/test_baselines_real.py::test_scaling_benchmark_runs_megatron_core_beside_the_home_made_megatron': 18.1,
}


COLLECTED: set[str] = set()  # this process's collection before any deselection (-m, --deselect), from mark_slow


def mark_slow(items) -> None:
    """Add the ``slow`` marker to every collected test listed in ``SLOW``."""
    import pytest

    COLLECTED.clear()
    for item in items:
        COLLECTED.add(item.nodeid)
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)


def stale(ids, config) -> list[str]:
    """``SLOW`` ids that name no collected test, when this run collected the whole ``tests`` folder (``[]`` else).

    A test renamed or re-parametrized would otherwise fall back into the fast tier unnoticed: the full suite (the
    README's test command, CI) fails on such an id instead (``tests/test_slow_tier.py`` reads the session's own
    collection, so the check costs nothing), and the list is fixed in the same change.
    """
    import pathlib

    here = pathlib.Path(__file__).resolve().parent
    whole = any(pathlib.Path(arg).resolve() in (here, here.parent) for arg in config.args)
    if not whole or config.option.keyword:
        return []
    files = {nodeid.split("::")[0] for nodeid in ids}
    # a file collected by no item (skipped as a whole where a package is missing) cannot be judged
    return sorted(i for i in SLOW if i.split("::")[0] in files and i not in ids)
