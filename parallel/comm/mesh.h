// DeviceMesh: world = dp × pp × tp ranks, tp innermost, so the chattiest groups (tensor parallel:
// 4 all-reduces per layer) are consecutive ranks, i.e. one node; data parallelism, which talks
// once per step, crosses nodes.
//   rank = (dp_idx * pp + pp_idx) * tp + tp_idx
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/comm/process_group.h"

namespace sg::comm {

struct MeshCoord {
  int dp = 0, pp = 0, tp = 0;
  bool operator==(const MeshCoord&) const = default;
};

class DeviceMesh {
 public:
  DeviceMesh(int dp, int pp, int tp);
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int tp() const { return tp_; }
  int world() const { return dp_ * pp_ * tp_; }

  int rank_of(MeshCoord c) const;
  MeshCoord coord_of(int rank) const;
  // The ranks that differ from `rank` only along one axis, ordered by that axis' index (so a
  // rank's position in the list is its rank in that group).
  std::vector<int> tp_ranks(int rank) const;
  std::vector<int> pp_ranks(int rank) const;
  std::vector<int> dp_ranks(int rank) const;

 private:
  int dp_, pp_, tp_;
};

struct MeshGroups {
  MeshCoord coord;
  std::shared_ptr<ProcessGroup> dp, pp, tp;
};
// Collective over `world`, whose size must be mesh.world(): this rank's three subgroups, each
// ranked by the coordinate along its axis.
MeshGroups create_mesh_groups(const DeviceMesh& mesh, ProcessGroup& world);

// A layout that fits the model and the batch, with what each rank then holds.
struct MeshPlan {
  DeviceMesh mesh;
  int64_t heads_per_rank;        // n_head / tp
  int64_t vocab_rows_per_rank;   // vocab / tp
  int64_t layers_per_stage;      // n_layer / pp
  int64_t batch_per_rank;        // global_batch / dp
  int64_t micro_batch;
  int64_t micro_batches;         // batch_per_rank / micro_batch
};
// Refuses, before any work, a layout that does not divide evenly, naming the flag and the reason:
// "--tp 3: 4 heads cannot be split 3 ways". vocab is the number of embedding rows (padded).
MeshPlan validate_mesh(int world, int tp, int pp, int64_t n_head, int64_t n_layer, int64_t vocab, int64_t global_batch,
                       int64_t micro_batch);

}  // namespace sg::comm
