// shardgrad export: a checkpoint's model as one Hugging Face-named GPT-2 .safetensors file; `train
// --init-from` and the Python ecosystem read it. Either format: a sharded checkpoint is
// consolidated tensor by tensor (each from the pieces of every rank's file, checksums verified),
// and its optimizer state is never read.
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/commands.h"
#include "io/file.h"
#include "parallel/sharded_checkpoint.h"

namespace sg::cli {

int export_main(int argc, char** argv) {
  Args a("export", "Write a checkpoint's weights as one Hugging Face GPT-2 .safetensors file.");
  a.positional("checkpoint", "run directory, step directory, or auto:RUN (full or sharded)");
  a.flag("out", "", "the .safetensors file to write (must not exist)");
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
  io::save_safetensors(out, tensors, c->metadata());
  std::printf("exported %zu tensors from %s to %s\n", tensors.size(), c->path().c_str(), out.c_str());
  return 0;
}

}  // namespace sg::cli
