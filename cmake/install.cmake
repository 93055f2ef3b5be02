# Install rules and the exported package of grpo. Included by the top-level
# CMakeLists.txt when GRPO_INSTALL is on (the default for a top-level build).
#
# What a consumer gets after `cmake --install`:
#   <prefix>/include/grpo/*.hpp          public headers
#   <prefix>/lib/libgrpo.{a,so*}         static or shared, as BUILD_SHARED_LIBS chose
#   <prefix>/lib/libgrpo_baseline.*      the unfused comparison paths (grpo::baseline), apart
#   <prefix>/lib/cmake/grpo/             grpoConfig.cmake, grpoConfigVersion.cmake, grpo*Targets*.cmake
#   <prefix>/lib/pkgconfig/grpo.pc
# and uses it with find_package(grpo) + target_link_libraries(app grpo::grpo).

# The public headers use std::span and designated initializers: consumers must
# compile as C++20 at least. CMAKE_CXX_STANDARD does not propagate to users, a
# compile feature on the interface does (and ends up in grpoTargets.cmake).
target_compile_features(grpo PUBLIC cxx_std_20)

set(GRPO_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/grpo CACHE STRING
    "Where grpoConfig.cmake is installed, relative to the prefix")
mark_as_advanced(GRPO_INSTALL_CMAKEDIR)

# Static (the default) or shared, as BUILD_SHARED_LIBS chose. A static
# libgrpo exports its private dependencies as $<LINK_ONLY:...> link items that
# the package config must find; a shared one resolves them through its own
# DT_NEEDED entries (libdnnl, libtbb, libgomp from the system's lib dir).
get_target_property(GRPO_LIBRARY_TYPE grpo TYPE)
if(GRPO_LIBRARY_TYPE STREQUAL "SHARED_LIBRARY")
  set(GRPO_STATIC_LIBRARY OFF)
else()
  set(GRPO_STATIC_LIBRARY ON)
endif()

install(TARGETS grpo
  EXPORT grpoTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT grpo_development
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT grpo_runtime NAMELINK_COMPONENT grpo_development
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT grpo_runtime)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/grpo
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT grpo_development
  FILES_MATCHING PATTERN "*.hpp" PATTERN "mpi_communicator.hpp" EXCLUDE)

install(EXPORT grpoTargets
  NAMESPACE grpo::
  FILE grpoTargets.cmake
  DESTINATION ${GRPO_INSTALL_CMAKEDIR} COMPONENT grpo_development)

# grpo::baseline (grpo/baseline.hpp): the unfused comparison paths, in their
# own library and export set so that linking grpo::grpo never pulls them in;
# a consumer who wants to measure against them links grpo::baseline.
target_compile_features(grpo_baseline PUBLIC cxx_std_20)
install(TARGETS grpo_baseline
  EXPORT grpoBaselineTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT grpo_development
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT grpo_runtime NAMELINK_COMPONENT grpo_development
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT grpo_runtime)
install(EXPORT grpoBaselineTargets
  NAMESPACE grpo::
  FILE grpoBaselineTargets.cmake
  DESTINATION ${GRPO_INSTALL_CMAKEDIR} COMPONENT grpo_development)

# grpo::mpi, when built: its own export set (grpoMpiTargets.cmake), which the
# package config loads only where find_package(MPI) succeeds, so users
# without MPI still get grpo::grpo.
if(TARGET grpo_mpi)
  target_compile_features(grpo_mpi PUBLIC cxx_std_20)
  install(TARGETS grpo_mpi
    EXPORT grpoMpiTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT grpo_development
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT grpo_runtime NAMELINK_COMPONENT grpo_development
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT grpo_runtime)
  install(FILES ${PROJECT_SOURCE_DIR}/include/grpo/mpi_communicator.hpp
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/grpo COMPONENT grpo_development)
  install(EXPORT grpoMpiTargets
    NAMESPACE grpo::
    FILE grpoMpiTargets.cmake
    DESTINATION ${GRPO_INSTALL_CMAKEDIR} COMPONENT grpo_development)
endif()

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/grpoConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/grpoConfig.cmake
  INSTALL_DESTINATION ${GRPO_INSTALL_CMAKEDIR}
  NO_SET_AND_CHECK_MACRO NO_CHECK_REQUIRED_COMPONENTS_MACRO)
# 0.x releases promise nothing across minor versions in general, but within
# one major version the API only grows: a user asking for 0.1 accepts 0.2.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/cmake/grpoConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/cmake/grpoConfig.cmake
  ${PROJECT_BINARY_DIR}/cmake/grpoConfigVersion.cmake
  DESTINATION ${GRPO_INSTALL_CMAKEDIR} COMPONENT grpo_development)

# pkg-config: for a static libgrpo the dependencies go to Libs.private /
# Requires.private (pkg-config --static adds them); for a shared one the
# consumer's link line needs -lgrpo only. oneDNN ships no .pc file on Debian,
# hence the bare -ldnnl; libgomp comes with -fopenmp.
if(GRPO_STATIC_LIBRARY)
  set(GRPO_PC_REQUIRES_PRIVATE "tbb")
  set(GRPO_PC_LIBS_PRIVATE "-ldnnl -fopenmp -lstdc++ -lm")
else()
  set(GRPO_PC_REQUIRES_PRIVATE "")
  set(GRPO_PC_LIBS_PRIVATE "")
endif()
# Relocatable when the install dirs are relative (the usual case): the prefix
# is found from where grpo.pc itself lies.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(GRPO_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(GRPO_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(GRPO_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH GRPO_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
  string(REGEX REPLACE "/$" "" GRPO_PC_TO_PREFIX "${GRPO_PC_TO_PREFIX}")
  set(GRPO_PC_PREFIX "\${pcfiledir}/${GRPO_PC_TO_PREFIX}")
  set(GRPO_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(GRPO_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/grpo.pc.in ${PROJECT_BINARY_DIR}/grpo.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/grpo.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT grpo_development)
