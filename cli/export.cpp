// shardgrad export: a checkpoint's model as one Hugging Face-named GPT-2 .safetensors file,
// checked against the checkpoint's checksums; `train --init-from` and the Python ecosystem read it.
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/commands.h"
#include "parallel/checkpoint.h"

namespace sg::cli {

int export_main(int argc, char** argv) {
  Args a("export", "Write a checkpoint's weights as one Hugging Face GPT-2 .safetensors file.");
  a.positional("checkpoint", "run directory, step directory, or auto:RUN");
  a.flag("out", "", "the .safetensors file to write (must not exist)");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const std::string out = a.str("out");
  SG_CHECK(!out.empty(), "export: --out is required");
  SG_CHECK(!std::filesystem::exists(out), "export: ", out, " already exists; refusing to overwrite it");
  ckpt::LoadedCheckpoint c = ckpt::load_checkpoint(a.str("checkpoint"));
  io::NamedTensors tensors;
  for (const auto& name : c.model.order) tensors.emplace_back(name, c.model.at(name));
  io::save_safetensors(out, tensors, c.model.metadata);
  std::printf("exported %zu tensors from %s to %s\n", tensors.size(), c.path.c_str(), out.c_str());
  return 0;
}

}  // namespace sg::cli
