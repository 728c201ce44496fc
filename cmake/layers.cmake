# The layers of src/ as CMake targets, and the rule that a layer includes only the headers of
# the layers below it (docs/ARCHITECTURE.md, "Layers").
#
# flux8_layer(NAME <layer> [DIR <folder under src/>] [USES <layers>...] [EXECUTABLE <name>]
#             [LINK_WHOLE]) declares one layer:
#   - its sources: every .cpp (and .cu) directly in its folder and in subfolders that are not
#     layers of their own (src/backend/cpu and src/backend/cuda are);
#   - the static library flux8_<layer> (dashes become underscores), or the executable <name>,
#     linked to the libraries of the layers it USES. LINK_WHOLE: every executable using it links
#     the library whole, for the static registrations in it (the backend implementations:
#     registry.h; NCCL: dist/process_groups.h); a library layer using it sees its headers only;
#   - its include tree, build/include/<layer>/: one symbolic link per visible layer (the layer
#     itself and everything it uses, directly or not) to that layer's folder in src/. The
#     library's only include path into src/ is that tree, so including a header of a layer it
#     may not use fails to compile ("No such file or directory").
# A layer must be declared after the layers it uses.

set(FLUX8_INCLUDE_TREES ${CMAKE_BINARY_DIR}/include)

# The folders under src/ that are layers of their own, though nested in another layer's folder.
set(FLUX8_NESTED_LAYER_DIRS backend/cpu backend/cuda dist/nccl)

# The layers `layer` may include: itself and the closure of what it uses.
function(_flux8_visible_layers layer out_var)
  set(visible ${layer})
  foreach(used ${FLUX8_LAYER_${layer}_USES})
    list(APPEND visible ${FLUX8_LAYER_${used}_VISIBLE})
  endforeach()
  list(REMOVE_DUPLICATES visible)
  set(${out_var} ${visible} PARENT_SCOPE)
endfunction()

# Links <tree>/<dir> to src/<dir>. A folder that holds nested layers (src/backend) becomes a
# real folder with one link per entry instead, leaving the nested layers out unless they are
# visible themselves; its entries are globbed with CONFIGURE_DEPENDS, so a file added there
# later reruns this at the next build.
function(_flux8_link_layer_dir tree dir)
  set(nested "")
  foreach(n ${FLUX8_NESTED_LAYER_DIRS})
    if(n MATCHES "^${dir}/")
      list(APPEND nested ${n})
    endif()
  endforeach()
  if(NOT nested)
    get_filename_component(parent ${tree}/${dir} DIRECTORY)
    file(MAKE_DIRECTORY ${parent})
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/src/${dir} ${tree}/${dir} SYMBOLIC)
    return()
  endif()
  file(MAKE_DIRECTORY ${tree}/${dir})
  file(GLOB entries CONFIGURE_DEPENDS LIST_DIRECTORIES true RELATIVE ${CMAKE_SOURCE_DIR}/src/${dir}
       ${CMAKE_SOURCE_DIR}/src/${dir}/*)
  foreach(entry ${entries})
    if(NOT "${dir}/${entry}" IN_LIST nested)
      file(CREATE_LINK ${CMAKE_SOURCE_DIR}/src/${dir}/${entry} ${tree}/${dir}/${entry} SYMBOLIC)
    endif()
  endforeach()
endfunction()

function(flux8_layer)
  cmake_parse_arguments(L "LINK_WHOLE" "NAME;DIR;EXECUTABLE" "USES" ${ARGN})
  if(NOT L_DIR)
    set(L_DIR ${L_NAME})
  endif()
  foreach(used ${L_USES})
    if(NOT DEFINED FLUX8_LAYER_${used}_DIR)
      message(FATAL_ERROR "layer ${L_NAME} uses ${used}, which is not declared before it")
    endif()
  endforeach()
  set(FLUX8_LAYER_${L_NAME}_DIR ${L_DIR} CACHE INTERNAL "")
  set(FLUX8_LAYER_${L_NAME}_USES ${L_USES} CACHE INTERNAL "")
  _flux8_visible_layers(${L_NAME} visible)
  set(FLUX8_LAYER_${L_NAME}_VISIBLE ${visible} CACHE INTERNAL "")

  set(tree ${FLUX8_INCLUDE_TREES}/${L_NAME})
  file(REMOVE_RECURSE ${tree})
  file(MAKE_DIRECTORY ${tree})
  foreach(v ${visible})
    _flux8_link_layer_dir(${tree} ${FLUX8_LAYER_${v}_DIR})
  endforeach()

  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/${L_DIR}/*.cpp
       ${CMAKE_SOURCE_DIR}/src/${L_DIR}/*.cu)
  foreach(n ${FLUX8_NESTED_LAYER_DIRS})
    if(n MATCHES "^${L_DIR}/")
      list(FILTER sources EXCLUDE REGEX "^${CMAKE_SOURCE_DIR}/src/${n}/")
    endif()
  endforeach()
  if(L_EXECUTABLE)
    set(target ${L_EXECUTABLE})
    add_executable(${target} ${sources})
  else()
    string(REPLACE "-" "_" target flux8_${L_NAME})
    add_library(${target} STATIC ${sources})
  endif()
  set(FLUX8_LAYER_${L_NAME}_TARGET ${target} CACHE INTERNAL "")
  set(FLUX8_LAYER_${L_NAME}_LINK ${target} CACHE INTERNAL "")
  set(FLUX8_LAYER_${L_NAME}_WHOLE ${L_LINK_WHOLE} CACHE INTERNAL "")
  if(L_LINK_WHOLE)
    set(FLUX8_LAYER_${L_NAME}_LINK "$<LINK_LIBRARY:WHOLE_ARCHIVE,${target}>" CACHE INTERNAL "")
  endif()
  target_include_directories(${target} PRIVATE ${tree})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
  foreach(used ${L_USES})
    # A library using a LINK_WHOLE layer (dist-nccl uses backend-cuda) sees its headers but does
    # not link it: the executables link that layer whole themselves, and CMake allows one
    # feature per library on a link line (a plain link beside the whole one is an error).
    if(NOT (FLUX8_LAYER_${used}_WHOLE AND NOT L_EXECUTABLE))
      target_link_libraries(${target} PUBLIC ${FLUX8_LAYER_${used}_LINK})
    endif()
  endforeach()
endfunction()

# A test that a layer cannot include a header of `forbidden_header`'s layer: it compiles one
# line including that header with the layer's include tree and flags and passes only when the
# compiler stops because the header is not found.
function(flux8_layer_include_test layer forbidden_header)
  set(probe_dir ${CMAKE_BINARY_DIR}/layer_probes)
  string(MAKE_C_IDENTIFIER "${layer}_${forbidden_header}" probe)
  set(test_name layers.${layer}.cannot_include.${forbidden_header})
  file(WRITE ${probe_dir}/${probe}.cpp "#include \"${forbidden_header}\"\n")
  add_library(layer_probe_${probe} OBJECT EXCLUDE_FROM_ALL ${probe_dir}/${probe}.cpp)
  target_include_directories(layer_probe_${probe} PRIVATE ${FLUX8_INCLUDE_TREES}/${layer})
  target_link_libraries(layer_probe_${probe} PRIVATE ${FLUX8_LAYER_${layer}_TARGET})
  add_test(NAME ${test_name}
           COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${CMAKE_BINARY_DIR} -DTARGET=layer_probe_${probe}
                   -DHEADER=${forbidden_header} -P ${CMAKE_SOURCE_DIR}/cmake/expect_missing_header.cmake)
  # Each builds in this build tree: one at a time.
  set_tests_properties(${test_name} PROPERTIES LABELS layers RESOURCE_LOCK build_tree)
endfunction()
