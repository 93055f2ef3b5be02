// grpo::MpiCommunicator: MPI_Allgather / MPI_Alltoall of bytes.
#include "grpo/mpi_communicator.hpp"

#include <climits>
#include <string>

#include "grpo/types.hpp"

namespace grpo {
namespace {

int count_of(std::size_t bytes, const char* what) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    throw Error(
        "communicator",
        std::string(what) + " of " + std::to_string(bytes) + " bytes per rank exceeds MPI's int count (2^31 - 1)",
        ErrorKind::unsupported);
  }
  return static_cast<int>(bytes);
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

void MpiCommunicator::allgather(const void* send, void* recv, std::size_t bytes) const {
  const int count = count_of(bytes, "an allgather");
  const bool in_place = send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
  MPI_Allgather(in_place ? MPI_IN_PLACE : send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_);
}

void MpiCommunicator::alltoall(const void* send, void* recv, std::size_t bytes) const {
  const int count = count_of(bytes, "an alltoall");
  MPI_Alltoall(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_);
}

}  // namespace grpo
