// grpo::Communicator on an MPI communicator: the optional grpo::mpi target
// (library grpo_mpi, built when CMake finds MPI). The core library never
// links MPI; link grpo::mpi only where the ranks are MPI processes.
//
//   #include <grpo/mpi_communicator.hpp>
//
//   MPI_Init(&argc, &argv);
//   grpo::MpiCommunicator world(MPI_COMM_WORLD);   // borrowed, not freed
//   grpo::LmHeadOptions options;
//   options.scale_out.data_group = &world;          // see grpo/communicator.hpp
//
//   // A grid: ranks with the same batch form a vocab group, ranks with the
//   // same shard a data group (MPI_Comm_split by batch index / shard index).
//   MPI_Comm by_batch, by_shard;
//   MPI_Comm_split(MPI_COMM_WORLD, batch_index, shard_index, &by_batch);
//   MPI_Comm_split(MPI_COMM_WORLD, shard_index, batch_index, &by_shard);
//   grpo::MpiCommunicator vocab(by_batch), data(by_shard);
//
// Ownership: the MPI_Comm is borrowed; MPI must be initialized before and
// finalized after every call. Threads: the library calls the communicator
// only from the thread that calls the plan (MPI_THREAD_FUNNELED suffices).
// Collectives are MPI_Allgather / MPI_Alltoall of MPI_BYTE; no MPI reduction
// is ever used (the library adds in rank order itself). Errors follow the
// communicator's MPI error handler (MPI_ERRORS_ARE_FATAL by default); a
// message of more than 2^31 - 1 bytes per rank throws grpo::Error (the
// library's messages are bounded by kReduceSegmentBytes and a token block's
// row statistics).
#pragma once

#include <mpi.h>

#include "grpo/communicator.hpp"

namespace grpo {

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allgather(const void* send, void* recv, std::size_t bytes) const override;
  void alltoall(const void* send, void* recv, std::size_t bytes) const override;

  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace grpo
