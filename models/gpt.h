// GPT-2: learned positions, pre-LN blocks (attention then GELU-tanh MLP), final LayerNorm, the
// output head tied to the token embedding. The body is a flat list of calls, as in llm.c.
#pragma once
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "models/module.h"

namespace sg::comm {
class ProcessGroup;
}
namespace sg::parallel::tp {
class ParallelAttention;
class ParallelMLP;
class VocabParallelEmbedding;
}  // namespace sg::parallel::tp

namespace sg::nn {

enum class Recompute { none, selective, full };
Recompute parse_recompute(const std::string& s);

// The rows of wte for a vocabulary split tp ways: rounded up to a multiple of 64 (whole tiles for
// the logits' GEMM) that tp divides (each rank an equal slice, as Megatron's padding to 128 x tp).
// The padding rows are zero, never looked up and never predicted, so the losses do not depend on
// it; checkpoints hold the real rows only, so a run resumes under another tp.
int64_t padded_vocab_rows(int64_t vocab_size, int64_t tp = 1);

struct GPTConfig {
  std::string name = "custom";
  int64_t n_layer = 12, n_head = 12, n_embd = 768;
  int64_t block_size = 1024;   // longest sequence (rows of wpe)
  int64_t vocab_size = 50257;  // real vocabulary
  int64_t padded_vocab = 0;    // rows of wte; 0 = padded_vocab_rows(vocab_size, tp)
  double dropout = 0.0;
  double ln_eps = 1e-5;
  // Tensor-parallel degree: > 1 builds the blocks, the embedding and the head from parallel/tp
  // over the group given to GPT (heads and vocabulary rows split tp ways).
  int64_t tp = 1;
  // With tp > 1: activations outside the tensor-parallel regions are split along the sequence
  // (parallel/tp/layers.h); gradients of replicated parameters then need
  // parallel::tp::sync_sequence_parallel_grads after backward. Dropout draws the masks of this
  // rank's positions (the dropout place's t0, which the trainer sets).
  bool sequence_parallel = false;
  int64_t vocab_rows() const;  // padded_vocab (rounded up to a multiple of tp) or the default
  int64_t head_dim() const { return n_embd / n_head; }
  void validate() const;  // throws naming the field
  // Ψ: parameter count (with the padded vocabulary rows, which is what is allocated).
  int64_t num_params() const;
  int64_t non_embedding_params() const;  // num_params() without wte and wpe (Kaplan et al.'s N)
  // A training step's model FLOPs per token at sequence length T: 6·(Ψ − wpe) + 12·L·T·C (PaLM's
  // MFU convention, as bench/RESULTS.md and the planner count: no recompute, no padding waste).
  double flops_per_token(int64_t T) const;
};

// tiny (tests), gpt2 (124M), gpt2-medium, gpt2-large, gpt2-xl. Throws for an unknown name.
GPTConfig gpt_preset(const std::string& name);

// The attention core on qkv [B, T, 3C] (q, k, v side by side, n_head heads each): causal
// attention per head, heads merged back to [B, T, C]. With recompute_core, only this core is
// re-run in backward (selective recompute: its saved q, k, v, out are not kept).
Tensor causal_attention(const Tensor& qkv, int64_t n_head, bool recompute_core);

// Dropout call sites (sg::dropout(x, p, site)): the embedding's, then each block's attention
// output and MLP output. A site and the element's place in the step's batch fix its mask.
constexpr int64_t kEmbedDropoutSite = 0;
inline int64_t attn_dropout_site(int64_t layer) { return 1 + 2 * layer; }
inline int64_t mlp_dropout_site(int64_t layer) { return 2 + 2 * layer; }

class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const GPTConfig& c, DType dtype, Device device);
  // With residual: residual + the attention's output, the add inside c_proj's GEMM when there is
  // no dropout.
  Tensor forward(const Tensor& x, bool recompute_core, const Tensor& residual = Tensor()) const;
  const char* type_name() const override { return "CausalSelfAttention"; }
  std::shared_ptr<Linear> c_attn, c_proj;
  int64_t n_head;
  double dropout;
  int64_t dropout_site = 0;  // its block's attn_dropout_site
};

class MLP : public Module {
 public:
  MLP(const GPTConfig& c, DType dtype, Device device);
  // With residual: residual + the MLP of x, the add inside c_proj's GEMM (sg::mlp).
  Tensor forward(const Tensor& x, const Tensor& residual = Tensor()) const;
  const char* type_name() const override { return "MLP"; }
  std::shared_ptr<Linear> c_fc, c_proj;
};

class Block : public Module {
 public:
  // With c.tp > 1: tp_attn and tp_mlp over tp_group (registered as "attn" and "mlp"), attn
  // and mlp null.
  // layer: the block's index in the model (its dropout sites).
  Block(const GPTConfig& c, DType dtype, Device device, std::shared_ptr<comm::ProcessGroup> tp_group = nullptr,
        int64_t layer = 0);
  // Calls pre_forward first and returns post_forward(output) when they are set.
  Tensor forward(const Tensor& x, Recompute rc) const;
  const char* type_name() const override { return "Block"; }
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<MLP> mlp;
  std::shared_ptr<parallel::tp::ParallelAttention> tp_attn;
  std::shared_ptr<parallel::tp::ParallelMLP> tp_mlp;
  double dropout;
  int64_t layer;
};

// The keys and values of the positions a model has seen, per layer: sampling one token at a time
// attends to them instead of running the whole window again (inference: GPT::forward_cached).
struct KVCache {
  std::vector<Tensor> k, v;  // per layer [B, n_head, len, head dim]
  int64_t len = 0;           // positions held
};

class GPT : public Module {
 public:
  // c.tp > 1 needs tp_group, of size c.tp: this rank then holds its slice of every split
  // parameter (parallel/tp/layers.h: gpt_param_split) and wte is null (tp_wte instead).
  explicit GPT(const GPTConfig& c, DType dtype = DType::f32, Device device = Device::cpu(),
               std::shared_ptr<comm::ProcessGroup> tp_group = nullptr);
  const char* type_name() const override { return "GPT"; }
  // GPT-2 init from a seed: N(0, 0.02), residual projections N(0, 0.02/sqrt(2 n_layer)), zero
  // biases, unit LayerNorm gains; padded vocabulary rows zero. Each parameter draws from its own
  // Philox stream (named by the parameter), so the values do not depend on any sharding (under
  // tp, each rank keeps its slice of the full draw).
  void init_weights(uint64_t seed);
  // The same for one parameter (its model name, its tensor: a tensor of the same shape, such as
  // the parameter given memory in an FSDP unit's flat storage), the value init_weights gives it.
  void init_parameter(const std::string& name, const Tensor& p, uint64_t seed) const;
  // idx [B, T] -> logits [B, T, vocab_rows]; under tp, this rank's vocabulary slice
  // [B, T, vocab_rows / tp] (columns [rank * vocab_rows / tp, ...)), for the whole sequence
  // also under sequence parallelism (T must then divide by tp). GPT's own pre_forward runs before
  // the embeddings, post_forward on the logits (FSDP's root unit: wte, wpe, ln_f).
  Tensor forward(const Tensor& idx) const;
  // Mean cross-entropy over the targets that are not -1 (the padded columns never count).
  // With sum=true: the sum, times scale (for averaging over a global batch). Under tp, the
  // vocabulary-parallel cross-entropy (full logits are never gathered); the same on every rank.
  Tensor loss(const Tensor& idx, const Tensor& targets, bool sum = false, double scale = 1.0) const;
  // The pieces of forward, which the pipeline's stages run separately (no pre/post_forward):
  // token + position embeddings (+ dropout; under sequence parallelism this rank's positions),
  // the head (ln_f, then the tied wte as the output projection) from the last block's output,
  // and the loss from the head's logits.
  Tensor embed(const Tensor& idx) const;
  Tensor head(const Tensor& h_out) const;
  // Inference with a KV cache (plain models, no dropout, no hooks): the logits [B, T, vocab_rows]
  // of idx [B, T] at positions cache.len .. cache.len + T - 1, each attending to every cached
  // position and causally to the new ones; their keys and values join the cache. Either the
  // cache is empty (a prompt of any length), or T is 1 (one sampled token); the positions must
  // stay within block_size. Equals forward() on the whole sequence, to rounding.
  Tensor forward_cached(const Tensor& idx, KVCache& cache) const;
  // The logits are consumed (moved into the fused classifier when nothing else holds them).
  Tensor loss_from_logits(Tensor logits, const Tensor& targets, bool sum, double scale) const;

  GPTConfig config;
  Recompute recompute = Recompute::none;
  std::shared_ptr<Embedding> wte, wpe;
  std::vector<std::shared_ptr<Block>> h;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<parallel::tp::VocabParallelEmbedding> tp_wte;
  std::shared_ptr<comm::ProcessGroup> tp_group;
};

// The global names of a GPT's parameters in registration order, from the config alone (no
// tensors, nothing on any ledger): what a whole model holds whatever the layout that splits it.
std::vector<std::string> gpt_parameter_names(const GPTConfig& c);

// Hugging Face GPT-2 names and layouts: Conv1D weights are [in, out] there and [out, in] here;
// wte has vocab_size rows there and vocab_rows here. Unsharded models only (tp == 1).
io::NamedTensors hf_state_dict(const GPT& model);
// Loads a Hugging Face-named state into the model (a "transformer." prefix and attn.bias /
// attn.masked_bias buffers accepted; lm_head.weight accepted when it equals wte). Every
// expected tensor must be present with the right shape and finite (no NaN or inf); errors name the
// tensor and the file. A model split over tp (config.tp > 1) takes its tp rank's slice of each tensor.
// Tensors the file was read without (io::load_safetensors's filter) are shape-checked only, and
// only for parameters the model does not hold (on a meta device). With `only`, the parameters it
// names alone are loaded (an FSDP unit's, given memory one unit at a time); the file is checked
// as a whole all the same.
void load_hf_state(GPT& model, const io::SafetensorsFile& file,
                   const std::function<bool(const std::string& name)>& only = {});
// The filter that reads a Hugging Face-named file's tensors for the parameters the model holds
// (not on a meta device: a pipeline rank's other stages'), lm_head.weight beside a held wte.
io::TensorFilter hf_tensors_held(const GPT& model);
// The filter that reads the tensors of the parameters named (lm_head.weight beside wte).
io::TensorFilter hf_tensors_of(std::set<std::string> names);
// The config a Hugging Face-named file describes (n_layer from h.N, n_embd and vocab from wte,
// block_size from wpe); n_head must come from metadata ("n_head") or the caller.
GPTConfig config_from_hf(const io::SafetensorsFile& file, int64_t n_head_hint = 0);

}  // namespace sg::nn
