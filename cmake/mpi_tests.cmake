# tests/mpi: tests that need several processes. One executable, its own main (tests/mpi/main.cpp
# starts the job and gives the tests its process groups), run by CTest under mpirun at each size
# in FLUX8_MPI_TEST_SIZES; a test that needs another size skips itself. A failing rank makes
# mpirun exit non-zero.
set(FLUX8_MPI_TEST_SIZES 1 2 4 CACHE STRING "mpirun -np sizes the tests/mpi suite runs at")
file(GLOB FLUX8_MPI_TEST_SOURCES CONFIGURE_DEPENDS tests/mpi/*.cpp)
if(FLUX8_MPI_TEST_SOURCES)
  add_executable(flux8_mpi_tests ${FLUX8_MPI_TEST_SOURCES})
  target_include_directories(flux8_mpi_tests PRIVATE tests)
  target_link_libraries(flux8_mpi_tests PRIVATE flux8_all GTest::gtest)
  target_compile_definitions(flux8_mpi_tests PRIVATE FLUX8_BINARY="$<TARGET_FILE:flux8>")
  add_dependencies(flux8_mpi_tests flux8)
  # Open MPI refuses root without these two; containers often forbid the cross-process copy
  # (ptrace) its shared-memory transport tries first. One OpenMP thread a rank: the ranks share
  # the machine's cores.
  set(FLUX8_MPI_TEST_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
      OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
      ASAN_OPTIONS=detect_leaks=0:check_initialization_order=1:strict_init_order=1)
  foreach(np ${FLUX8_MPI_TEST_SIZES})
    add_test(NAME mpi.np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
                     $<TARGET_FILE:flux8_mpi_tests>)
    set_tests_properties(mpi.np${np} PROPERTIES LABELS mpi ENVIRONMENT "${FLUX8_MPI_TEST_ENV}" TIMEOUT 1200
                         PROCESSORS ${np})
  endforeach()
endif()
