// `flux8 init`: write MLPerf-initialised weights in the reference (or diffusers) format.
#include <fmt/core.h>

#include "backend/backend.h"
#include "cli/commands.h"
#include "config/config.h"
#include "model/flux_model.h"
#include "model/weights_io.h"

namespace flux8::cli {

Command add_init_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("init", "write freshly initialised weights (MLPerf init) as safetensors");
  struct Opts {
    ConfigOptions cfg;
    std::string out, dtype = "bf16", naming = "reference";
    uint64_t seed = 0;
    bool seed_given = false;
  };
  auto o = std::make_shared<Opts>();
  o->cfg.add_to(*cmd);
  cmd->add_option("--out", o->out, "output .safetensors")->required();
  cmd->add_option("--seed", o->seed, "initialisation seed (default: config seed)");
  cmd->add_option("--dtype", o->dtype, "file dtype")->check(CLI::IsMember({"bf16", "f32", "f16"}));
  cmd->add_option("--naming", o->naming, "tensor names: reference (Black Forest Labs) or diffusers")
      ->check(CLI::IsMember({"reference", "diffusers"}));
  return {cmd, [o, cmd]() {
            const Config config = Config::load(o->cfg.config, o->cfg.overrides);
            const FluxConfig cfg = FluxConfig::from_config(config);
            const uint64_t seed = cmd->count("--seed") ? o->seed : static_cast<uint64_t>(config.get_int("seed"));
            std::unique_ptr<Backend> be = make_backend("cpu");
            FluxModel model(cfg, *be, DType::f32);
            model.params().init(seed);
            const DType dt = o->dtype == "f32" ? DType::f32 : o->dtype == "f16" ? DType::f16 : DType::bf16;
            save_weights(model.params(), cfg, o->out, dt,
                         o->naming == "diffusers" ? WeightNaming::diffusers : WeightNaming::reference,
                         {{"producer", "flux8 init"},
                          {"model", cfg.name},
                          {"seed", std::to_string(seed)},
                          {"config", config.dump()}});
            fmt::print("wrote {} ({} parameters, {}, {} names)\n", o->out, model.params().layout().total(), o->dtype,
                       o->naming);
            return 0;
          }};
}

}  // namespace flux8::cli
