# ctest helper: runs grpo-microbench on CONFIG with JSON output to OUT and
# fails unless every counter the issue names is in the JSON.
#   cmake -DMICROBENCH=... -DCONFIG=... -DOUT=... -P check_json_counters.cmake
execute_process(
  COMMAND ${MICROBENCH} --config ${CONFIG} --quiet --benchmark_out=${OUT} --benchmark_out_format=json
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "grpo-microbench exited with ${rc}")
endif()
file(READ ${OUT} json)
foreach(counter step_s_mean step_s_p50 step_s_p90 first_call_s peak_bytes peak_rss_delta_bytes
        gflops gemm_roofline_frac loss clip_ratio_low clip_ratio_high clip_ratio_region)
  if(NOT json MATCHES "\"${counter}\": ")
    message(FATAL_ERROR "counter ${counter} is missing from ${OUT}")
  endif()
endforeach()
message(STATUS "every counter present in ${OUT}")
