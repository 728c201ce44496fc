# ctest script (flux8_layer_include_test in layers.cmake): builds TARGET in BUILD_DIR and passes
# only when that build fails because HEADER cannot be found. A build that succeeds means a
# layer can include a header it must not; a build failing for any other reason is reported as
# such, so the test cannot pass by accident.
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled: its layer can include ${HEADER}, which the layering forbids "
                      "(see the include trees in cmake/layers.cmake)")
endif()
string(REPLACE "." "\\." header_regex "${HEADER}")
if(NOT out MATCHES "${header_regex}: No such file or directory" AND NOT out MATCHES "'${header_regex}' file not found")
  message(FATAL_ERROR "${TARGET} failed to build, but not for a missing ${HEADER}:\n${out}")
endif()
message(STATUS "${TARGET}: ${HEADER} is not visible, as the layering requires")
