# ctest helper: runs grpo-mpi-bench on CONFIG under mpirun (MPIEXEC, RANKS,
# MPIEXEC_FLAGS as a ;-list) with JSON output to OUT, and fails unless the
# counters issue 9 names are in the JSON and the distributed loss equals the
# single-process loss of the same invocation.
#   cmake -DMPIEXEC=... -DRANKS=2 -DMPIEXEC_FLAGS=... -DBENCH=... -DCONFIG=... -DOUT=... -P check_mpi_json_counters.cmake
execute_process(
  COMMAND ${MPIEXEC} -n ${RANKS} ${MPIEXEC_FLAGS} ${BENCH} --config ${CONFIG} --quiet --benchmark_out=${OUT}
          --benchmark_out_format=json
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "grpo-mpi-bench exited with ${rc}")
endif()
file(READ ${OUT} json)
math(EXPR last "${RANKS} - 1")
set(counters step_s_p50 step_s_mean first_call_s peak_bytes peak_rss_delta_bytes comm_bytes_sent_per_step
    comm_collectives_per_step single_step_s single_peak_bytes speedup_vs_single peak_ratio_vs_single loss
    single_loss loss_diff_vs_single ranks)
foreach(q RANGE ${last})
  list(APPEND counters peak_bytes_rank${q} comm_bytes_sent_per_step_rank${q})
endforeach()
foreach(counter ${counters})
  string(JSON value ERROR_VARIABLE missing GET "${json}" benchmarks 0 ${counter})
  if(missing)
    message(FATAL_ERROR "counter ${counter} is missing from ${OUT}")
  endif()
  set(${counter} ${value})
endforeach()
if(NOT ranks EQUAL RANKS)
  message(FATAL_ERROR "ranks ${ranks}, expected ${RANKS}")
endif()
if(NOT loss_diff_vs_single EQUAL 0)
  message(FATAL_ERROR "loss ${loss} differs from the single process's ${single_loss} (tile-aligned shards: bitwise)")
endif()
if(NOT comm_bytes_sent_per_step GREATER 0)
  message(FATAL_ERROR "comm_bytes_sent_per_step is ${comm_bytes_sent_per_step}")
endif()
message(STATUS "every counter present in ${OUT}; ${comm_bytes_sent_per_step} bytes sent per rank per step")
