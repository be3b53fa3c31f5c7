# dynadiag_check_jax_cuda_plugin(<nvcc version> <python> [<dir>...])
# Fails the configure when a JAX CUDA plugin installed for <python> (jax-cuda12-plugin,
# jax-cuda13-plugin, ...; listed by jax_cuda_plugin.py, in <dir>s if given) targets another CUDA
# major version than nvcc: the handlers link their own CUDA runtime from nvcc's toolkit, which must
# be the major version JAX loads in the same process. No plugin installed (a CPU-only JAX): no check.
# Tests run this file directly: cmake -DCUDA_VERSION=13.0 -DPYTHON=python [-DPLUGIN_PATH=dir] -P it.
function(dynadiag_check_jax_cuda_plugin cuda_version python)
  execute_process(
    COMMAND "${python}" "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/jax_cuda_plugin.py" ${ARGN}
    OUTPUT_VARIABLE plugins ERROR_VARIABLE err RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "dynadiag: could not list the installed JAX CUDA plugins with ${python}:\n${err}")
  endif()
  string(REGEX MATCH "^[0-9]+" nvcc_major "${cuda_version}")
  string(REPLACE "\n" ";" plugins "${plugins}")
  foreach(line IN LISTS plugins)
    if(NOT line MATCHES "^([^ ]+) ([^ ]+) ([0-9]+)$")
      continue()
    endif()
    set(name "${CMAKE_MATCH_1}")
    set(version "${CMAKE_MATCH_2}")
    set(plugin_major "${CMAKE_MATCH_3}")
    if(NOT plugin_major EQUAL nvcc_major)
      message(FATAL_ERROR
        "dynadiag: nvcc is CUDA ${cuda_version}, but JAX's CUDA plugin ${name} ${version} is built "
        "for CUDA ${plugin_major} (installed for ${python}). The CUDA handlers would carry a CUDA "
        "${nvcc_major} runtime into a process where JAX runs CUDA ${plugin_major}. Use a CUDA "
        "${plugin_major} nvcc (first on PATH, or CUDACXX=/path/to/nvcc), install jax[cuda${nvcc_major}] "
        "instead, or build without the CUDA handlers (DYNADIAG_CUDA=OFF).")
    endif()
    message(STATUS "dynadiag: nvcc CUDA ${cuda_version} matches ${name} ${version}")
  endforeach()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(DEFINED PLUGIN_PATH)
    dynadiag_check_jax_cuda_plugin("${CUDA_VERSION}" "${PYTHON}" "${PLUGIN_PATH}")
  else()
    dynadiag_check_jax_cuda_plugin("${CUDA_VERSION}" "${PYTHON}")
  endif()
endif()
