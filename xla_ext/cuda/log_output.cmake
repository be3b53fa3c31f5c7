# Compiler launcher: runs the command after "--", prints its output as usual and also writes it to
# LOG, so the build keeps ptxas's resource report (-Xptxas=-v) of the device code it ships.
#   cmake -DLOG=<file> -P log_output.cmake -- <compiler> <arguments...>
set(command "")
set(after_separator FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(after_separator)
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif("${CMAKE_ARGV${i}}" STREQUAL "--")
    set(after_separator TRUE)
  endif()
endforeach()
if(NOT LOG OR command STREQUAL "")
  message(FATAL_ERROR "usage: cmake -DLOG=<file> -P log_output.cmake -- <command...>")
endif()
execute_process(COMMAND ${command} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err
  ECHO_OUTPUT_VARIABLE ECHO_ERROR_VARIABLE)
file(WRITE "${LOG}" "${out}${err}")
if(NOT status EQUAL 0)
  message(FATAL_ERROR "compiler failed (${status})")
endif()
