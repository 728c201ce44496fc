# FLUX8_FUZZ: builds the libFuzzer targets of tests/fuzz (one per input format flux8 parses)
# with AddressSanitizer and UndefinedBehaviorSanitizer. libFuzzer comes with clang, so this
# needs clang (CMAKE_CXX_COMPILER=clang++) and the CPU backend only; scripts/fuzz.sh configures
# build-fuzz/ this way and builds only the fuzz targets and the layers they link.
option(FLUX8_FUZZ "build the libFuzzer targets of tests/fuzz (clang)" OFF)
if(FLUX8_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "FLUX8_FUZZ needs clang for libFuzzer (found ${CMAKE_CXX_COMPILER_ID}): configure with "
                        "-DCMAKE_CXX_COMPILER=clang++ (scripts/install_deps.sh installs it)")
  endif()
  if(FLUX8_HAVE_CUDA)
    message(FATAL_ERROR "FLUX8_FUZZ builds the CPU code only: configure with -DFLUX8_CUDA=OFF")
  endif()
  if(FLUX8_SANITIZE)
    message(FATAL_ERROR "FLUX8_FUZZ sets its own sanitizers: leave FLUX8_SANITIZE empty")
  endif()
  # Every library gets the coverage instrumentation libFuzzer steers by (fuzzer-no-link); only
  # the fuzz executables link libFuzzer itself (tests/fuzz/CMakeLists.txt).
  set(FLUX8_FUZZ_FLAGS -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                       -fno-omit-frame-pointer -gline-tables-only)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${FLUX8_FUZZ_FLAGS}>")
  add_link_options(-fsanitize=address,undefined)
endif()
