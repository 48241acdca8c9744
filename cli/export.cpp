// shardgrad export: a checkpoint's model as one Hugging Face-named GPT-2 .safetensors file and its
// config.json; `train --init-from`, `generate` and transformers' GPT2LMHeadModel read them. Either
// format: a sharded checkpoint is consolidated tensor by tensor (each from the pieces of every
// rank's file, checksums verified), and its optimizer state is never read.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/commands.h"
#include "io/file.h"
#include "models/gpt.h"
#include "parallel/sharded_checkpoint.h"

namespace sg::cli {

int export_main(int argc, char** argv) {
  Args a("export", "Write a checkpoint's weights as one Hugging Face GPT-2 .safetensors file.");
  a.positional("checkpoint", "run directory, step directory, or auto:RUN (full or sharded)");
  a.flag("out", "", "the .safetensors file to write (must not exist); a config.json for transformers goes beside it");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const std::string out = a.str("out");
  SG_CHECK(!out.empty(), "export: --out is required");
  SG_CHECK(!std::filesystem::exists(out), "export: ", out, " already exists; refusing to overwrite it");
  std::unique_ptr<ckpt::Checkpoint> c = ckpt::open_checkpoint(a.str("checkpoint"));
  io::NamedTensors tensors = ckpt::hf_model_tensors(*c);
  SG_CHECK(!tensors.empty(), "export: ", c->path(), " holds no model parameters");
  io::make_parent_folder(out, "export: --out");
  // Hugging Face's loader takes a file whose "format" is "pt"; shardgrad's own keys (the model's
  // shape, the data) stay beside it.
  io::SafetensorsFile file;
  file.path = c->path();  // (not out: a config.json beside out is checked below, against this model)
  file.metadata = c->metadata();
  file.metadata["format"] = "pt";
  for (auto& [n, t] : tensors) file.order.push_back(n), file.tensors[n] = t;
  const nn::GPTConfig cfg = nn::config_from_hf(file);  // the head count from the checkpoint's metadata
  // transformers' GPT2LMHeadModel.from_pretrained(folder) reads the architecture from config.json
  // beside the weights (model.safetensors; the head ties to wte, as here). One that is there
  // already must describe this model: checked before anything is written.
  nlohmann::json config = {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"},
                           {"vocab_size", cfg.vocab_size},       {"n_positions", cfg.block_size},
                           {"n_ctx", cfg.block_size},            {"n_embd", cfg.n_embd},
                           {"n_layer", cfg.n_layer},             {"n_head", cfg.n_head},
                           {"activation_function", "gelu_new"},  {"layer_norm_epsilon", cfg.ln_eps},
                           {"tie_word_embeddings", true},        {"resid_pdrop", 0.0},
                           {"embd_pdrop", 0.0},                  {"attn_pdrop", 0.0}};
  // GPT-2's tokenizer ends a text with <|endoftext|>, id 50256; a model with fewer rows (bytes, the
  // synthetic task) has no such token: null, not transformers' default 50256, past its vocabulary.
  const nlohmann::json end_of_text = cfg.vocab_size > 50256 ? nlohmann::json(50256) : nlohmann::json(nullptr);
  config["bos_token_id"] = end_of_text;
  config["eos_token_id"] = end_of_text;
  const std::filesystem::path config_path = std::filesystem::path(out).parent_path() / "config.json";
  const bool have_config = std::filesystem::exists(config_path);
  if (have_config) {
    const nlohmann::json there = nlohmann::json::parse(io::read_file(config_path.string(), "export"), nullptr, false);
    SG_CHECK(there.is_object(), "export: ", config_path.string(), " is there already and is not a JSON object; export "
             "to another folder, or remove it");
    // The keys that shape the model must agree (those that must be there, and those that may be);
    // others (dropout, torch_dtype, transformers_version, token ids) are the file's own.
    std::string differ;
    for (const char* key : {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head"})
      if (!there.contains(key) || there[key] != config[key]) differ += str(differ.empty() ? "" : ", ", key);
    for (const char* key : {"model_type", "n_ctx", "activation_function", "layer_norm_epsilon", "tie_word_embeddings"})
      if (there.contains(key) && there[key] != config[key]) differ += str(differ.empty() ? "" : ", ", key);
    SG_CHECK(differ.empty(), "export: ", config_path.string(), " is there already and describes another model than ",
             c->path(), " (", cfg.n_layer, " layers, ", cfg.n_head, " heads, width ", cfg.n_embd, ", vocab ",
             cfg.vocab_size, "; it differs in ", differ, "); export to another folder, or remove it");
  }
  io::save_safetensors(out, tensors, file.metadata);
  std::printf("exported %zu tensors from %s to %s\n", tensors.size(), c->path().c_str(), out.c_str());
  if (!have_config)
    io::write_text_atomic(config_path.string(), "export: config.json",
                          config.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  std::printf("%s %s (GPT2LMHeadModel: %lld layers, %lld heads, width %lld, vocab %lld)%s\n",
              have_config ? "kept" : "wrote", config_path.string().c_str(), (long long)cfg.n_layer,
              (long long)cfg.n_head, (long long)cfg.n_embd, (long long)cfg.vocab_size,
              std::filesystem::path(out).filename() == "model.safetensors"
                  ? ""
                  : "; transformers' from_pretrained(folder) looks for model.safetensors, not this name: rename "
                    "the file (or export with --out FOLDER/model.safetensors) to load the folder");
  return 0;
}

}  // namespace sg::cli
