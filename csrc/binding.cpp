// Torch binding of the DLite CUDA kernels: CUDA implementations of the `dlite::` custom ops.
//
// The op schemas and their fake (meta) implementations are defined in Python
// (vllm_dlite/ops/cuda_ops.py) so that torch.compile / fake-tensor tracing and the CPU tests work
// without this library; this file only registers the CUDA kernels (TORCH_LIBRARY_IMPL). The
// dispatcher accepts an impl registered before its schema, so import order does not matter.
//
// Outputs are allocated here with the caching allocator on the current stream (CUDA-graph safe:
// no host syncs, no device-wide calls). DLITE_POISON_OUTPUTS=1 fills outputs and scratch with
// NaN / -1 before the launch, so a correctness check catches every element a kernel did not write.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <tuple>

#include "dlite_kernels.h"

namespace {

dlite::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return dlite::DType::kFloat32;
    case at::kHalf: return dlite::DType::kFloat16;
    case at::kBFloat16: return dlite::DType::kBFloat16;
    default: TORCH_CHECK(false, "dlite: unsupported dtype ", t);
  }
}

bool poison_enabled() {
  const char* v = std::getenv("DLITE_POISON_OUTPUTS");
  return v != nullptr && v[0] == '1';
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.is_cuda(), "dlite: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == ref.device(), "dlite: ", name, " is on ", t.device(), ", expected ",
              ref.device());
}

void check_aligned(const at::Tensor& t, const char* name) {
  // kernels read rows with 16-byte vector loads
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "dlite: ", name,
              " must be 16-byte aligned");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "dlite::", op, ": CUDA error: ", cudaGetErrorString(err));
}

// ------------------------------------------------------------------------------ draft attention
at::Tensor draft_attention_cuda(const at::Tensor& q, const at::Tensor& k_ctx,
                                const at::Tensor& v_ctx, const at::Tensor& k_q,
                                const at::Tensor& v_q, const at::Tensor& cos,
                                const at::Tensor& sin, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_ctx.dim() == 4 && k_q.dim() == 4,
              "dlite::draft_attention_v1: q, k_ctx, k_q must be 4-D");
  const int64_t B = q.size(0), Q = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t L = k_ctx.size(1), Hkv = k_ctx.size(2);
  TORCH_CHECK(k_ctx.sizes() == at::IntArrayRef({B, L, Hkv, D}) && v_ctx.sizes() == k_ctx.sizes(),
              "dlite::draft_attention_v1: k_ctx/v_ctx must be [b, L, h_kv, D]");
  TORCH_CHECK(k_q.sizes() == at::IntArrayRef({B, Q, Hkv, D}) && v_q.sizes() == k_q.sizes(),
              "dlite::draft_attention_v1: k_q/v_q must be [b, Q, h_kv, D]");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({L + Q, D}) && sin.sizes() == cos.sizes(),
              "dlite::draft_attention_v1: cos/sin must be [L + Q, D]");
  for (const auto* t : {&k_ctx, &v_ctx, &k_q, &v_q})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dlite::draft_attention_v1: dtype mismatch");
  check_cuda(k_ctx, q, "k_ctx");
  check_cuda(v_ctx, q, "v_ctx");
  check_cuda(k_q, q, "k_q");
  check_cuda(v_q, q, "v_q");
  check_cuda(cos, q, "cos");
  check_cuda(sin, q, "sin");
  const char* why = dlite::draft_attention_unsupported(int(B), int(Q), int(L), int(Hq), int(Hkv),
                                                       int(D));
  TORCH_CHECK(why == nullptr, "dlite::draft_attention_v1: ", why ? why : "");

  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k_ctx.contiguous(), vc = v_ctx.contiguous(),
                   kq = k_q.contiguous(), vq = v_q.contiguous();
  // the reference casts cos/sin to the activation dtype before rotating: same values here
  const at::Tensor cos32 = cos.to(q.scalar_type()).to(at::kFloat).contiguous();
  const at::Tensor sin32 = sin.to(q.scalar_type()).to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(qc);
  if (poison_enabled()) out.fill_(std::numeric_limits<double>::quiet_NaN());
  if (B == 0) return out;
  for (const auto& [t, name] : {std::pair{&qc, "q"}, {&kc, "k_ctx"}, {&vc, "v_ctx"},
                               {&kq, "k_q"}, {&vq, "v_q"}, {&out, "out"}})
    check_aligned(*t, name);

  dlite::DraftAttentionArgs a{};
  a.q = qc.data_ptr();
  a.k_ctx = kc.data_ptr();
  a.v_ctx = vc.data_ptr();
  a.k_q = kq.data_ptr();
  a.v_q = vq.data_ptr();
  a.cos = cos32.data_ptr<float>();
  a.sin = sin32.data_ptr<float>();
  a.out = out.data_ptr();
  a.B = int(B);
  a.Q = int(Q);
  a.L = int(L);
  a.Hq = int(Hq);
  a.Hkv = int(Hkv);
  a.D = int(D);
  a.scale = float(scale);
  a.dtype = to_dtype(q.scalar_type());
  check_launch(dlite::draft_attention_launch(a, c10::cuda::getCurrentCUDAStream().stream()),
               "draft_attention_v1");
  return out;
}

// ------------------------------------------------------------------------------ sequential head
std::tuple<at::Tensor, at::Tensor> sequential_head_greedy_cuda(
    const at::Tensor& d, const at::Tensor& anchor_ids, const std::optional<at::Tensor>& prime_ids,
    const at::Tensor& prev_token_embedding, const at::Tensor& state_proj_weight,
    const at::Tensor& state_proj_bias, const at::Tensor& hidden_mlp_weight,
    const at::Tensor& hidden_mlp_bias, const at::Tensor& output_proj_weight, int64_t k) {
  constexpr const char* op = "dlite::sequential_head_greedy_v1: ";
  TORCH_CHECK(d.dim() == 3, op, "d must be [b, K, H]");
  const int64_t B = d.size(0), K = d.size(1), H = d.size(2);
  TORCH_CHECK(output_proj_weight.dim() == 2, op, "output_proj_weight must be [V, r]");
  const int64_t V = output_proj_weight.size(0), r = output_proj_weight.size(1);
  TORCH_CHECK(k >= 0 && k <= K, op, "k (tokens drafted this round) must be in 0..K");
  TORCH_CHECK(anchor_ids.sizes() == at::IntArrayRef({B}) && anchor_ids.scalar_type() == at::kLong,
              op, "anchor_ids must be int64 [b]");
  const bool primed = prime_ids.has_value();
  if (primed)
    TORCH_CHECK(prime_ids->sizes() == at::IntArrayRef({B}) && prime_ids->scalar_type() == at::kLong,
                op, "prime_ids must be int64 [b]");
  TORCH_CHECK(prev_token_embedding.sizes() == at::IntArrayRef({V, r}), op,
              "prev_token_embedding must be [V, r] like output_proj_weight");
  TORCH_CHECK(state_proj_weight.sizes() == at::IntArrayRef({2 * r, 2 * r}) &&
                  state_proj_bias.sizes() == at::IntArrayRef({2 * r}),
              op, "state_proj must be [2r, 2r] + [2r]");
  TORCH_CHECK(hidden_mlp_weight.sizes() == at::IntArrayRef({r, r + H}) &&
                  hidden_mlp_bias.sizes() == at::IntArrayRef({r}),
              op, "state_hidden_mlp must be [r, r + H] + [r]");
  const auto dt = output_proj_weight.scalar_type();
  for (const auto* t : {&prev_token_embedding, &state_proj_weight, &state_proj_bias,
                        &hidden_mlp_weight, &hidden_mlp_bias})
    TORCH_CHECK(t->scalar_type() == dt, op, "all head weights must have output_proj's dtype");
  TORCH_CHECK(d.is_floating_point(), op, "d must be floating point");
  check_cuda(anchor_ids, d, "anchor_ids");
  if (primed) check_cuda(*prime_ids, d, "prime_ids");
  for (const auto& [t, name] :
       {std::pair{&prev_token_embedding, "prev_token_embedding"},
        {&state_proj_weight, "state_proj_weight"}, {&state_proj_bias, "state_proj_bias"},
        {&hidden_mlp_weight, "hidden_mlp_weight"}, {&hidden_mlp_bias, "hidden_mlp_bias"},
        {&output_proj_weight, "output_proj_weight"}})
    check_cuda(*t, d, name);
  const char* why = dlite::sequential_head_unsupported(int(H), int(r), V, to_dtype(dt));
  TORCH_CHECK(why == nullptr, op, why ? why : "");
  TORCH_CHECK(output_proj_weight.is_contiguous() && prev_token_embedding.is_contiguous(), op,
              "output_proj_weight and prev_token_embedding must be contiguous");

  const c10::cuda::CUDAGuard guard(d.device());
  // the reference feeds d_k.to(head dtype) into the readout
  const at::Tensor dc = d.to(dt).contiguous(), ids_in = anchor_ids.contiguous(),
                   ws = state_proj_weight.contiguous(), bs = state_proj_bias.contiguous(),
                   wf = hidden_mlp_weight.contiguous(), bf = hidden_mlp_bias.contiguous();
  const at::Tensor prime_in = primed ? prime_ids->contiguous() : at::Tensor();
  at::Tensor draft_ids = at::empty({B, k}, d.options().dtype(at::kLong));
  at::Tensor logits = at::empty({B, k, V}, d.options().dtype(at::kFloat));
  const bool poison = poison_enabled();
  if (poison) {
    draft_ids.fill_(-1);
    logits.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  if (B == 0 || k == 0) return {draft_ids, logits};
  for (const auto& [t, name] :
       {std::pair{&dc, "d"}, {&prev_token_embedding, "prev_token_embedding"},
        {&ws, "state_proj_weight"}, {&wf, "hidden_mlp_weight"},
        {&output_proj_weight, "output_proj_weight"}})
    check_aligned(*t, name);
  at::Tensor workspace = at::empty(
      {int64_t(dlite::sequential_head_workspace_bytes(int(H), int(r), int(k)))},
      d.options().dtype(at::kByte));

  dlite::SequentialHeadArgs a{};
  a.d = dc.data_ptr();
  a.anchor = ids_in.data_ptr<int64_t>();
  a.prime = primed ? prime_in.data_ptr<int64_t>() : nullptr;
  a.emb = prev_token_embedding.data_ptr();
  a.w_s = ws.data_ptr();
  a.b_s = bs.data_ptr();
  a.w_f = wf.data_ptr();
  a.b_f = bf.data_ptr();
  a.w_o = output_proj_weight.data_ptr();
  a.B = int(B);
  a.K = int(K);
  a.H = int(H);
  a.r = int(r);
  a.num_steps = int(k);  // one head step per drafted token
  a.V = V;
  a.dtype = to_dtype(dt);
  a.draft_ids = draft_ids.data_ptr<int64_t>();
  a.logits = logits.data_ptr<float>();
  a.workspace = workspace.data_ptr();
  a.poison_workspace = poison;
  check_launch(
      dlite::sequential_head_greedy_launch(a, c10::cuda::getCurrentCUDAStream().stream()),
      "sequential_head_greedy_v1");
  return {draft_ids, logits};
}

}  // namespace

TORCH_LIBRARY_IMPL(dlite, CUDA, m) {
  m.impl("draft_attention_v1", &draft_attention_cuda);
  m.impl("sequential_head_greedy_v1", &sequential_head_greedy_cuda);
}

// `import vllm_dlite._C` loads this library (and so registers the kernels above). No Python API.
#define DLITE_CONCAT_(a, b) a##b
#define DLITE_CONCAT(a, b) DLITE_CONCAT_(a, b)
#define DLITE_STR_(a) #a
#define DLITE_STR(a) DLITE_STR_(a)
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

PyMODINIT_FUNC DLITE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, DLITE_STR(TORCH_EXTENSION_NAME),
                                      "DLite CUDA kernels (registered as torch.ops.dlite.*)", 0,
                                      nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
