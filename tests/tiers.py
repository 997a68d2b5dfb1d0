"""The two tiers of the CPU tests: the fast one samples, the full one covers.

``python -m pytest`` runs the fast tier: of each family of parameter sets
listed in ``SAMPLED`` it runs the given number, spread over the family (the
first always among them); the tests in ``SLOW`` and the rest of those
families are marked ``slow`` and not run; Hypothesis tests draw a fifth of
their examples (``examples``). ``python -m pytest --full`` runs everything,
every Hypothesis test at its full count (``.ci/run`` runs both tiers);
``-m slow`` runs only what the fast tier leaves out. A selection by ``-m``
(the GPU suite's ``-m gpu``) or by node id runs what it names, untiered.

Each name below must match collected tests (a renamed test fails the run
instead of silently leaving the fast tier), and the numbers are chosen from
measured times: the fast tier is what finishes in about five minutes on two
cores (``pytest --durations`` shows the slow ones).
"""

from __future__ import annotations

FULL = False  # set from --full by tests/conftest.py before the test modules load

# "file::test": how many of its parameter sets the fast tier runs.
SAMPLED = {
    "test_pallas.py::test_matches_reference": 1,
    "test_pallas.py::test_full_tiles": 1,
    "test_pallas.py::test_op_table_on_tiles": 12,
    "test_vmap_jvp.py::test_forward_mode_falls_back_for_implementation_none": 1,
    "test_vmap_jvp.py::test_reverse_mode_stays_fused": 1,
    "test_vmap_jvp.py::test_forward_mode_of_a_fused_backend_asked_by_name_is_refused": 3,
    "test_nonfinite_values.py::test_fused_route_follows_the_reference_rule": 1,
    "test_differential.py::test_reference_attention_matches_jax_on_random_mods": 1,
    "test_differential.py::test_pallas_kernels_match_reference_on_random_mods": 1,
    "test_differential.py::test_text_and_trace_values_match_jax": 1,
    "test_differential.py::test_derivatives_match_jax": 1,
    "test_differential.py::test_bit_ops_and_erfc_match_jax": 1,
    "test_differential.py::test_later_ops_match_jax": 1,
    "test_differential.py::test_custom_jvp_rules_at_infinite_cotangents": 1,
    "test_differential.py::test_masked_keys_never_contribute": 1,
    "test_blocks.py::test_sound_and_tight": 15,
    "test_blocks.py::test_random_differential_masks": 4,
    "test_blocks.py::test_random_congruences": 6,
    "test_blocks.py::test_random_row_intervals": 6,
    "test_blocks.py::test_lists_and_transpose_match_the_tiles": 1,
    "test_blocks.py::test_catalogue_masks_at_their_gpu_shapes": 1,
    "test_docs.py::test_doc_examples_run": 1,
    "test_route.py::test_which_implementation_names_what_attention_runs": 2,
    "test_plans.py::test_lowering_switches_from_the_environment": 2,
    "test_plan_store.py::test_jax_compilation_cache_opt_in": 2,
    "test_process_caches.py::test_a_folder_others_may_write_is_not_used": 1,
    "test_attention.py::test_gqa_and_lengths": 2,
    "test_attention.py::test_matches_naive": 4,
    "test_cudnn_rules.py::test_decoded_indices_divide_the_index_alone_in_the_graph": 2,
    "test_pallas_mosaic.py::test_offset_diagonals": 2,
    "test_pallas_mosaic.py::test_prepared_expression": 5,
    "test_trace_soundness.py::test_narrow_int_arithmetic_matches_jnp": 16,
    "test_masks.py::test_recognized_bands_compute_the_mods_mask": 16,
    "test_trace.py::test_new_ops_and_reductions_trace_to_jax_numpy_values": 6,
    "catalogue/test_catalogue.py::test_port_matches_the_numpy_reference": 5,
    "catalogue/test_catalogue.py::test_port_run_by_jax_alone_matches_the_reference": 10,
    "catalogue/test_catalogue.py::test_gradients_match_plain_attention_plus_the_reference_bias": 2,
    "test_positions.py::test_reference_path_reads_positions_and_lengths": 1,
    "test_sinks.py::test_extreme_sinks": 1,
    "test_positions.py::test_the_fused_pipeline_and_the_pallas_kernels_take_them": 1,
    "test_decode.py::test_the_fold_is_the_same_attention": 6,
    "test_pallas_mosaic.py::test_claimed_static_masks_interpreted": 2,
    "test_decode.py::test_the_fold_is_the_same_attention_on_random_mods": 1,
    "test_sinks.py::test_reference_path_is_the_softmax_with_one_more_column": 2,
    "test_pallas_mosaic.py::test_paged_forward_reads_the_pages_interpreted": 1,
    "test_pallas_mosaic.py::test_backward_learns_block_reads_interpreted": 1,
}

# "file::test": whole tests only the full tier runs (each over 5 s on two cores, with
# others in the fast tier that cover their code).
SLOW = {
    "test_sharding.py::test_on_eight_fake_devices",  # 8 XLA devices in a subprocess
    "test_attention.py::test_operand_gradients_run_on_the_pallas_kernels_under_grad_and_jit",
    "test_blocks.py::test_random_property_mods",
    "test_pallas.py::test_bucketed_relative_table_learns",
    "test_pallas.py::test_backward_protocol",
    "test_pallas.py::test_large_operand_gradient_refused",
    "test_gpu_runner.py::test_gpu_runner_resumes_a_run",
    "test_benchmarks.py::test_gpu_run_script_runs_tests_bench_and_probe_steps_on_the_cpu",
    "test_cudnn_rules.py::test_canonical_forms_compute_the_same_and_obey_the_rules",
    "test_vmap_jvp.py::test_jvp_with_automatic_choice_falls_back_with_a_warning",
    "test_varlen.py::test_cross_attention_with_decreasing_ids_takes_the_dense_route",
    "test_properties.py::test_nested_division_rewrites_hold_for_every_int32",
    "test_pallas.py::test_shapes",
    "test_varlen.py::test_cross_attention_with_other_lengths",
    "test_nonfinite_values.py::test_under_vmap",
    "test_process_caches.py::test_an_entry_moved_over_another_is_compiled_again_not_run",
    "test_examples.py::test_gemma2_block",
    "test_pallas.py::test_masked_keys_never_contribute",
    "test_pallas.py::test_half_precision",
    "test_split.py::test_blocks_compute_the_same_attention_and_gradients",
    "test_varlen.py::test_backend_matches_the_reference",
    "test_vmap_jvp.py::test_a_refusal_found_when_building_falls_back_for_implementation_none",
    "test_vmap_jvp.py::test_nested_vmap_with_per_example_operands",
    "test_vmap_jvp.py::test_operand_derivatives_fall_back_or_are_refused",
    "test_vmap_jvp.py::test_jvp_and_linearize_on_the_reference_path",
    "test_vmap_jvp.py::test_vmap_of_unbatched_keys_and_lse",
    "test_lowrank.py::test_augmented_reference_equals_the_mod_as_written",
    "test_benchmarks.py::test_int_division_probe_runs_on_the_cpu",
    "test_process_caches.py::test_plain_jax_entries_are_not_trusted",
    "test_trace_soundness.py::test_pickle_round_trips_across_processes",
    "test_trace_soundness.py::test_traced_mods_do_not_stay_interned",
    "test_lowrank.py::test_factors_broadcast_over_batch_and_heads",
    "test_pallas.py::test_through_attention_jit_grad_remat",
    "test_pallas.py::test_deterministic",
    "test_differential.py::test_fused_forms_match_jax",
    "test_varlen.py::test_bf16_and_jit",
    "test_attention.py::test_cudnn_yields_masks_of_captured_arrays_to_the_pallas_kernels",
    "test_examples.py::test_config_mods",
    "test_blocks.py::test_relative_positions_are_bounded_on_their_diagonals",
    "test_pallas.py::test_op_groups_through_the_kernels",  # test_op_table_on_tiles samples the ops
    "test_nonfinite_values.py::test_finite_values_take_one_call",
    "test_vmap_jvp.py::test_vmap_a_backend_cannot_fold_is_refused_clearly",
    "test_varlen.py::test_known_ids_compute_their_sequences_when_traced",
    "test_pallas_mosaic.py::test_vector_arrays",
    "test_gpu_runner.py::test_gpu_runner_writes_junit_log_and_one_summary_line",
    "test_sinks.py::test_forward_mode_and_second_order_with_sinks",
    "test_sinks.py::test_pallas_kernels_take_sinks",
    # test_positions' fused-standin case runs the fused pipeline with sinks in the fast tier
    "test_sinks.py::test_through_the_fused_pipeline",
    "test_sinks.py::test_reference_gradients_match_float64_finite_differences",
}


def examples(n: int) -> int:
    """A Hypothesis test's example count: ``n`` in the full tier, a fifth (at
    least 5) in the fast one."""
    return n if FULL else max(5, n // 5)


def spread(count: int, keep: int) -> set:
    """The indices of ``keep`` of ``count`` parameter sets, spread evenly over
    them, the first included."""
    keep = min(keep, count)
    return {i * count // keep for i in range(keep)}
