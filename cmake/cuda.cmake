# The CUDA backend's toolchain: nvcc for Hopper (sm_90a), cuBLASLt and cuDNN.
# Defines FLUX8_HAVE_CUDA and flux8_link_cuda(target).
set(FLUX8_HAVE_CUDA OFF)
# Where NCCL lives when it is not in the CUDA toolkit (e.g. the nvidia-nccl Python wheel).
set(FLUX8_NCCL_ROOT "" CACHE PATH "NCCL install root (include/, lib/) if not inside the CUDA toolkit")
if(NOT FLUX8_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(FLUX8_HAVE_CUDA ON)
  elseif(FLUX8_CUDA STREQUAL "ON")
    message(FATAL_ERROR "FLUX8_CUDA=ON but no CUDA compiler was found: set CUDACXX or put nvcc on PATH")
  else()
    message(STATUS "flux8: no CUDA compiler found, building the CPU backend only")
  endif()
endif()

if(FLUX8_HAVE_CUDA)
  # Hopper only: the FP8 tensor-core GEMMs and the kernels use sm_90a features.
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90a)
  endif()
  enable_language(CUDA)
  # C++20 for device code too (the shared headers use it). CMake < 3.26 does not know nvcc's
  # CUDA20 dialect flag (and takes CUDA_STANDARD from CXX_STANDARD): teach it the flag.
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  find_package(CUDAToolkit REQUIRED)
  set(_cudnn_hints ${FLUX8_CUDNN_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${_cudnn_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include REQUIRED)
  # The Python wheels ship only the versioned library (libcudnn.so.9).
  find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${_cudnn_hints} ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib lib64 REQUIRED)
  set(_nccl_hints ${FLUX8_NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include REQUIRED)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib lib64 REQUIRED)
  message(STATUS "flux8: CUDA backend for ${CMAKE_CUDA_ARCHITECTURES} (nvcc ${CMAKE_CUDA_COMPILER_VERSION}), cuDNN ${CUDNN_LIBRARY}, NCCL ${NCCL_LIBRARY}")
  add_compile_definitions(FLUX8_HAVE_CUDA=1)
endif()

function(flux8_link_cuda target)
  target_include_directories(${target} PUBLIC ${CUDNN_INCLUDE_DIR} ${NCCL_INCLUDE_DIR})
  # ${CMAKE_DL_LIBS}: NVML is opened at run time (nvml.cpp), never linked.
  target_link_libraries(${target} PUBLIC CUDA::cudart CUDA::cublasLt ${CUDNN_LIBRARY} ${NCCL_LIBRARY} ${CMAKE_DL_LIBS})
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
  # fmt turns its constexpr off under nvcc (old nvcc bugs), which breaks its consteval
  # format-string checks; nvcc 12+ handles them, so turn it back on.
  target_compile_definitions(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:FMT_USE_CONSTEXPR=1>)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr --extended-lambda -Xcompiler=-Wall,-Wno-unused-parameter>)
endfunction()
