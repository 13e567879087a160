# mok's install rules and CMake package: `cmake --install <build dir> --prefix <dir>` installs the
# public headers (include/mok), the static libraries and lib/cmake/mok/{mokConfig,
# mokConfigVersion,mokTargets}.cmake, so that a consumer writes
#   find_package(mok CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE mok::mok)     # or mok::core: the CPU reference engine only
# Only the libraries declared with mok_library() are installed; tests and benchmarks are not.
# Included from the top-level CMakeLists.txt after src/ (MOK_INSTALL).
include(CMakePackageConfigHelpers)

set(MOK_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/mok" CACHE STRING
    "Where the CMake package files go, relative to the install prefix")

get_property(_mok_targets GLOBAL PROPERTY MOK_LIBRARY_TARGETS)
install(TARGETS ${_mok_targets}
        EXPORT mokTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# Every public header (they include only each other, the standard library, CUDA and NCCL).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/mok
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp")
install(EXPORT mokTargets
        NAMESPACE mok::
        DESTINATION ${MOK_INSTALL_CMAKEDIR})

# What mokConfig.cmake needs to find the same dependencies mok was built with. The NCCL paths are
# the ones src/comm/CMakeLists.txt found (MOK_NCCL_ROOT): its device-API code is compiled against
# that NCCL, and the exported mok::comm links that libnccl.so.2 with an rpath to its directory.
get_filename_component(MOK_CUDA_TOOLKIT_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
set(MOK_CUDA_TOOLKIT_VERSION "${CUDAToolkit_VERSION_MAJOR}.${CUDAToolkit_VERSION_MINOR}")
if(TARGET mok_comm)
  get_target_property(MOK_NCCL_INCLUDE_DIR mok_comm MOK_NCCL_INCLUDE_DIR)
  get_target_property(MOK_NCCL_LIBRARY mok_comm MOK_NCCL_LIBRARY)
else()
  set(MOK_NCCL_INCLUDE_DIR "")
  set(MOK_NCCL_LIBRARY "")
endif()

configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/mokConfig.cmake.in
  ${PROJECT_BINARY_DIR}/mokConfig.cmake
  INSTALL_DESTINATION ${MOK_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/mokConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/mokConfig.cmake ${PROJECT_BINARY_DIR}/mokConfigVersion.cmake
        DESTINATION ${MOK_INSTALL_CMAKEDIR})
