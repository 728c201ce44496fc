// `flux8 forward`: run the model on given inputs and write the prediction (and, with
// --loss-grad, the parameter gradients of mean(pred·probe)), so flux8 can be checked against
// any other implementation.
#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/flux_model.h"
#include "model/input_batch.h"
#include "model/weights_io.h"

namespace flux8::cli {

namespace {

// --loss-grad's probe must be shaped like pred.
void check_probe(const SafetensorsReader& in_file, const std::vector<int64_t>& pred_dims) {
  const std::string pred_text = fmt::format("[{}]", fmt::join(pred_dims, ", "));
  if (!in_file.contains("probe"))
    fail("forward --loss-grad: inputs {} has no 'probe' tensor (shape {}, like pred)", in_file.path(), pred_text);
  const SafetensorsTensor& probe = in_file.tensor("probe");
  if (probe.shape != pred_dims)
    fail("forward --loss-grad: inputs {}: tensor 'probe' has shape [{}]; it must be {}, the shape of pred",
         in_file.path(), fmt::join(probe.shape, ", "), pred_text);
  if (!safetensors_converts(probe.dtype))
    fail("forward --loss-grad: inputs {}: tensor 'probe' has dtype {}; it must be F32, F64, BF16, F16, I32 or I64",
         in_file.path(), probe.dtype);
}

}  // namespace

Command add_forward_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("forward",
                                 "run the model on inputs from a safetensors file (img, img_ids, txt, txt_ids, "
                                 "timesteps, y, guidance) and write pred [and gradients]");
  struct Opts {
    ConfigOptions cfg;
    std::string checkpoint, inputs, out, precision = "f32";
    std::optional<uint64_t> init_seed;
    bool loss_grad = false, bf16_activations = false;
  };
  auto o = std::make_shared<Opts>();
  o->cfg.add_to(*cmd);
  cmd->add_option("--checkpoint", o->checkpoint,
                  "weights: a .safetensors file (reference or diffusers names; F32, BF16, F16 or FP8) or a "
                  "diffusers folder")
      ->check(CLI::ExistingPath);
  cmd->add_option("--init-seed", o->init_seed, "instead of --checkpoint: MLPerf initialisation from this seed");
  cmd->add_option("--inputs", o->inputs, "safetensors file with the model inputs")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", o->out, "output safetensors: pred [B, image tokens, out_channels]")->required();
  cmd->add_flag("--loss-grad", o->loss_grad,
                "also write loss = mean(pred*probe) and grad.<parameter> for every parameter "
                "(needs a 'probe' tensor shaped like pred in --inputs)");
  cmd->add_option("--precision", o->precision, "CPU arithmetic: f32, or f64 for reference checks")
      ->check(CLI::IsMember({"f32", "f64"}));
  cmd->add_flag("--bf16-activations", o->bf16_activations,
                "round activations to bf16 as the GPU stores them (f32 precision only)");
  return {cmd, [o]() {
            const Config config = Config::load(o->cfg.config, o->cfg.overrides);
            const FluxConfig cfg = FluxConfig::from_config(config);
            if (o->checkpoint.empty() == !o->init_seed.has_value())
              fail("forward: give exactly one of --checkpoint FILE or --init-seed N");
            const DType dtype = o->precision == "f64" ? DType::f64 : DType::f32;
            if (dtype == DType::f64 && o->bf16_activations) fail("forward: --bf16-activations needs --precision f32");
            BackendOptions bopts = BackendOptions::from_config(config);
            bopts.round_activations_to_bf16 = bopts.round_activations_to_bf16 || o->bf16_activations;
            std::unique_ptr<Backend> be = make_backend(config.get_string("backend"), bopts);

            // The inputs are checked before the model is built: a bad inputs file fails at once,
            // naming the tensor, instead of after the weights load or inside a model op.
            const SafetensorsReader in_file(o->inputs);
            const InputBatch::Extent extent = InputBatch::check(in_file, cfg);
            const std::vector<int64_t> pred_dims{extent.batch, extent.image_tokens, cfg.out_channels};
            if (o->loss_grad) check_probe(in_file, pred_dims);

            FluxModel model(cfg, *be, dtype);
            if (o->init_seed)
              model.params().init(*o->init_seed);
            else
              load_weights(model.params(), cfg, o->checkpoint);

            InputBatch batch(*be, dtype);
            batch.load(in_file, cfg);
            const Tensor pred = model.forward(batch.inputs());
            const Shape pred_shape{pred_dims[0], pred_dims[1], pred_dims[2]};
            FLUX8_CHECK(pred.shape == pred_shape, "pred is {}, not {}", pred.shape.str(), pred_shape.str());
            const std::vector<double> pred_host = to_host(*be, pred);

            // Outputs are stored in the precision of the run (F64 for --precision f64).
            SafetensorsWriter out;
            std::vector<std::vector<float>> keep32;  // host data must outlive write()
            std::vector<std::vector<double>> keep64;
            auto add = [&](const std::string& name, const Shape& shape, const std::vector<double>& v) {
              const std::vector<int64_t> dims(shape.d.begin(), shape.d.begin() + shape.rank);
              if (dtype == DType::f64) {
                keep64.push_back(v);
                out.add(name, DType::f64, dims, keep64.back().data());
              } else {
                keep32.emplace_back(v.begin(), v.end());
                out.add(name, DType::f32, dims, keep32.back().data());
              }
            };
            add("pred", pred.shape, pred_host);
            if (o->loss_grad) {
              std::vector<double> probe(static_cast<size_t>(in_file.tensor("probe").numel()));
              in_file.read_f64("probe", probe.data(), pred_dims);
              // loss = mean(pred·probe) -> dloss/dpred = probe / numel
              double loss = 0;
              std::vector<double> dpred(probe.size());
              for (size_t i = 0; i < probe.size(); ++i) {
                loss += pred_host[i] * probe[i];
                dpred[i] = probe[i] / static_cast<double>(probe.size());
              }
              loss /= static_cast<double>(probe.size());
              model.params().zero_grads();
              model.backward(batch.make(pred.shape, dpred));
              add("loss", Shape{1}, {loss});
              for (const ParamInfo& p : model.params().layout().params())
                add("grad." + p.name, p.shape, to_host(*be, model.params().grad(p.name)));
            }
            out.set_metadata("producer", "flux8 forward");
            out.set_metadata("model", cfg.name);
            out.write(o->out);
            fmt::print("wrote {} (pred {}{})\n", o->out, pred.shape.str(), o->loss_grad ? ", loss, grad.*" : "");
            return 0;
          }};
}

}  // namespace flux8::cli
