#include "parallel/comm/mesh.h"

#include "core/error.h"

namespace sg::comm {

DeviceMesh::DeviceMesh(int dp, int pp, int tp) : dp_(dp), pp_(pp), tp_(tp) {
  SG_CHECK(dp >= 1 && pp >= 1 && tp >= 1, "DeviceMesh: dp ", dp, ", pp ", pp, ", tp ", tp, " must all be at least 1");
}

int DeviceMesh::rank_of(MeshCoord c) const {
  SG_CHECK(c.dp >= 0 && c.dp < dp_ && c.pp >= 0 && c.pp < pp_ && c.tp >= 0 && c.tp < tp_, "DeviceMesh: coordinate (dp ",
           c.dp, ", pp ", c.pp, ", tp ", c.tp, ") is outside a ", dp_, "x", pp_, "x", tp_, " mesh");
  return (c.dp * pp_ + c.pp) * tp_ + c.tp;
}

MeshCoord DeviceMesh::coord_of(int rank) const {
  SG_CHECK(rank >= 0 && rank < world(), "DeviceMesh: rank ", rank, " is outside a mesh of ", world(), " ranks");
  return {rank / (pp_ * tp_), (rank / tp_) % pp_, rank % tp_};
}

std::vector<int> DeviceMesh::tp_ranks(int rank) const {
  MeshCoord c = coord_of(rank);
  std::vector<int> r;
  for (c.tp = 0; c.tp < tp_; ++c.tp) r.push_back(rank_of(c));
  return r;
}

std::vector<int> DeviceMesh::pp_ranks(int rank) const {
  MeshCoord c = coord_of(rank);
  std::vector<int> r;
  for (c.pp = 0; c.pp < pp_; ++c.pp) r.push_back(rank_of(c));
  return r;
}

std::vector<int> DeviceMesh::dp_ranks(int rank) const {
  MeshCoord c = coord_of(rank);
  std::vector<int> r;
  for (c.dp = 0; c.dp < dp_; ++c.dp) r.push_back(rank_of(c));
  return r;
}

MeshGroups create_mesh_groups(const DeviceMesh& mesh, ProcessGroup& world) {
  SG_CHECK(world.size() == mesh.world(), "create_mesh_groups: a ", mesh.dp(), "x", mesh.pp(), "x", mesh.tp(),
           " (dp x pp x tp) mesh needs ", mesh.world(), " ranks, the group has ", world.size());
  MeshCoord c = mesh.coord_of(world.rank());
  MeshGroups g;
  g.coord = c;
  // color = the coordinates that stay fixed within the group; key = the one that varies.
  g.tp = world.split(c.dp * mesh.pp() + c.pp, c.tp);
  g.pp = world.split(c.dp * mesh.tp() + c.tp, c.pp);
  g.dp = world.split(c.pp * mesh.tp() + c.tp, c.dp);
  return g;
}

MeshPlan validate_mesh(int world, int tp, int pp, int64_t n_head, int64_t n_layer, int64_t vocab, int64_t global_batch,
                       int64_t micro_batch) {
  SG_CHECK(tp >= 1, "--tp ", tp, ": tensor-parallel size must be at least 1");
  SG_CHECK(pp >= 1, "--pp ", pp, ": pipeline stages must be at least 1");
  SG_CHECK(world >= 1, "mesh: world size ", world, " must be at least 1");
  SG_CHECK(global_batch >= 1, "--batch-size ", global_batch, ": must be at least 1");
  SG_CHECK(micro_batch >= 1, "--micro-batch-size ", micro_batch, ": must be at least 1");
  SG_CHECK(world % (tp * pp) == 0, "--tp ", tp, " --pp ", pp, ": world size ", world, " is not divisible by tp x pp = ",
           tp * pp);
  const int dp = world / (tp * pp);
  SG_CHECK(n_head % tp == 0, "--tp ", tp, ": ", n_head, " heads cannot be split ", tp, " ways");
  SG_CHECK(vocab % tp == 0, "--tp ", tp, ": ", vocab, " vocabulary rows cannot be split ", tp,
           " ways (pad the vocabulary to a multiple of ", tp, ")");
  SG_CHECK(n_layer >= pp, "--pp ", pp, ": ", n_layer, " layers are fewer than ", pp, " stages");
  SG_CHECK(n_layer % pp == 0, "--pp ", pp, ": ", n_layer, " layers cannot be split evenly into ", pp, " stages");
  SG_CHECK(global_batch % dp == 0, "--batch-size ", global_batch, ": cannot be split across ", dp,
           " data-parallel ranks (world ", world, " / tp ", tp, " / pp ", pp, ")");
  const int64_t per_rank = global_batch / dp;
  SG_CHECK(per_rank % micro_batch == 0, "--micro-batch-size ", micro_batch, ": does not divide the per-rank batch ",
           per_rank, " (--batch-size ", global_batch, " / dp ", dp, ")");
  return MeshPlan{DeviceMesh(dp, pp, tp), n_head / tp, vocab / tp, n_layer / pp, per_rank, micro_batch,
                  per_rank / micro_batch};
}

}  // namespace sg::comm
