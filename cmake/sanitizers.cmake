# FLUX8_SANITIZE: a -fsanitize= list (e.g. "address,undefined") for every C++ target, the tests
# included. scripts/sanitize.sh builds the CPU test suite this way in build-asan/. Undefined
# behaviour stops the program (-fno-sanitize-recover) so a test that triggers it fails instead of
# printing a line that nobody reads.
set(FLUX8_SANITIZE "" CACHE STRING "sanitizers for all C++ code, e.g. address,undefined (empty: none)")
if(FLUX8_SANITIZE)
  if(FLUX8_HAVE_CUDA)
    message(FATAL_ERROR "FLUX8_SANITIZE builds the CPU backend only: configure with -DFLUX8_CUDA=OFF")
  endif()
  set(_flux8_sanitize_flags -fsanitize=${FLUX8_SANITIZE} -fno-omit-frame-pointer)
  if(FLUX8_SANITIZE MATCHES "undefined")
    list(APPEND _flux8_sanitize_flags -fno-sanitize-recover=undefined)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_flux8_sanitize_flags}>")
  add_link_options(-fsanitize=${FLUX8_SANITIZE})
endif()
