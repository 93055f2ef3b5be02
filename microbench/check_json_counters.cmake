# ctest helper: runs grpo-microbench on CONFIG with JSON output to OUT and
# fails unless every counter the issues name is in the JSON, and the step's
# executed GFLOP/s is a fraction in (0, 1] of the machine's measured peak.
#   cmake -DMICROBENCH=... -DCONFIG=... -DOUT=... -P check_json_counters.cmake
execute_process(
  COMMAND ${MICROBENCH} --config ${CONFIG} --quiet --benchmark_out=${OUT} --benchmark_out_format=json
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "grpo-microbench exited with ${rc}")
endif()
file(READ ${OUT} json)
foreach(counter step_s_mean step_s_p50 step_s_p90 first_call_s peak_bytes peak_rss_delta_bytes
        gflops executed_gflops machine_peak_gflops peak_frac unfused_gemms_s
        peak_f32_fma_gflops peak_avx512_bf16_gflops peak_amx_bf16_gflops
        loss clip_ratio_low clip_ratio_high clip_ratio_region)
  string(JSON value ERROR_VARIABLE missing GET "${json}" benchmarks 0 ${counter})
  if(missing)
    message(FATAL_ERROR "counter ${counter} is missing from ${OUT}")
  endif()
  set(${counter} ${value})
endforeach()
if(NOT machine_peak_gflops GREATER 0)
  message(FATAL_ERROR "machine_peak_gflops is ${machine_peak_gflops}: no peak measured for this config's dtype")
endif()
if(NOT executed_gflops GREATER 0 OR executed_gflops GREATER machine_peak_gflops)
  message(FATAL_ERROR "executed_gflops ${executed_gflops} outside (0, machine_peak_gflops ${machine_peak_gflops}]")
endif()
if(NOT peak_frac GREATER 0 OR peak_frac GREATER 1)
  message(FATAL_ERROR "peak_frac ${peak_frac} outside (0, 1]")
endif()
# The machine it ran on, in the context block (scripts/results_table.py reads it).
foreach(key cpu_model cpu_simd_flags cpu_units machine_peak_f32_fma_gflops machine_peak_avx512_bf16_gflops
        machine_peak_amx_bf16_gflops)
  string(JSON value ERROR_VARIABLE missing GET "${json}" context ${key})
  if(missing)
    message(FATAL_ERROR "context field ${key} is missing from ${OUT}")
  endif()
endforeach()
message(STATUS "every counter present in ${OUT}; peak_frac ${peak_frac} of ${machine_peak_gflops} GFLOP/s")
