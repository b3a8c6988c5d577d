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
at::Tensor draft_attention_cuda(const at::Tensor& q, const at::Tensor& k_feat,
                                const at::Tensor& v_feat, const at::Tensor& k_block,
                                const at::Tensor& v_block, const at::Tensor& cos,
                                const at::Tensor& sin, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_feat.dim() == 4 && k_block.dim() == 4,
              "dlite::draft_attention: q, k_feat, k_block must be 4-D");
  const int64_t B = q.size(0), K = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t L = k_feat.size(1), Hkv = k_feat.size(2);
  TORCH_CHECK(k_feat.sizes() == at::IntArrayRef({B, L, Hkv, D}) && v_feat.sizes() == k_feat.sizes(),
              "dlite::draft_attention: k_feat/v_feat must be [B, L, Hkv, D]");
  TORCH_CHECK(k_block.sizes() == at::IntArrayRef({B, K, Hkv, D}) &&
                  v_block.sizes() == k_block.sizes(),
              "dlite::draft_attention: k_block/v_block must be [B, K, Hkv, D]");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({K + 1, D}) && sin.sizes() == cos.sizes(),
              "dlite::draft_attention: cos/sin must be [K + 1, D]");
  for (const auto* t : {&k_feat, &v_feat, &k_block, &v_block})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dlite::draft_attention: dtype mismatch");
  check_cuda(k_feat, q, "k_feat");
  check_cuda(v_feat, q, "v_feat");
  check_cuda(k_block, q, "k_block");
  check_cuda(v_block, q, "v_block");
  check_cuda(cos, q, "cos");
  check_cuda(sin, q, "sin");
  const char* why = dlite::draft_attention_unsupported(int(B), int(K), int(L), int(Hq), int(Hkv),
                                                       int(D));
  TORCH_CHECK(why == nullptr, "dlite::draft_attention: ", why ? why : "");

  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kf = k_feat.contiguous(), vf = v_feat.contiguous(),
                   kb = k_block.contiguous(), vb = v_block.contiguous();
  const at::Tensor cos32 = cos.to(at::kFloat).contiguous(), sin32 = sin.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(qc);
  if (poison_enabled()) out.fill_(std::numeric_limits<double>::quiet_NaN());
  if (B == 0) return out;
  for (const auto& [t, name] : {std::pair{&qc, "q"}, {&kf, "k_feat"}, {&vf, "v_feat"},
                               {&kb, "k_block"}, {&vb, "v_block"}, {&out, "out"}})
    check_aligned(*t, name);

  dlite::DraftAttentionArgs a{};
  a.q = qc.data_ptr();
  a.k_feat = kf.data_ptr();
  a.v_feat = vf.data_ptr();
  a.k_block = kb.data_ptr();
  a.v_block = vb.data_ptr();
  a.cos = cos32.data_ptr<float>();
  a.sin = sin32.data_ptr<float>();
  a.out = out.data_ptr();
  a.B = int(B);
  a.K = int(K);
  a.L = int(L);
  a.Hq = int(Hq);
  a.Hkv = int(Hkv);
  a.D = int(D);
  a.scale = float(scale);
  a.dtype = to_dtype(q.scalar_type());
  check_launch(dlite::draft_attention_launch(a, c10::cuda::getCurrentCUDAStream().stream()),
               "draft_attention");
  return out;
}

// ------------------------------------------------------------------------------ sequential head
std::tuple<at::Tensor, at::Tensor> sequential_head_greedy_cuda(
    const at::Tensor& h, const at::Tensor& anchor_ids, const at::Tensor& embed_weight,
    const at::Tensor& w_in, const at::Tensor& w_state, const at::Tensor& w_out,
    const at::Tensor& norm_weight, const at::Tensor& lm_head_weight, double eps) {
  TORCH_CHECK(h.dim() == 3, "dlite::sequential_head_greedy: h must be [B, K, H]");
  const int64_t B = h.size(0), K = h.size(1), H = h.size(2);
  const int64_t r = w_in.size(0), V = lm_head_weight.size(0);
  TORCH_CHECK(anchor_ids.sizes() == at::IntArrayRef({B}) && anchor_ids.scalar_type() == at::kLong,
              "dlite::sequential_head_greedy: anchor_ids must be int64 [B]");
  TORCH_CHECK(embed_weight.dim() == 2 && embed_weight.size(1) == H,
              "dlite::sequential_head_greedy: embed_weight must be [V', H]");
  TORCH_CHECK(w_in.sizes() == at::IntArrayRef({r, H}) && w_state.sizes() == at::IntArrayRef({r, r}) &&
                  w_out.sizes() == at::IntArrayRef({H, r}),
              "dlite::sequential_head_greedy: w_in [r, H], w_state [r, r], w_out [H, r] expected");
  TORCH_CHECK(norm_weight.sizes() == at::IntArrayRef({H}) && lm_head_weight.dim() == 2 &&
                  lm_head_weight.size(1) == H,
              "dlite::sequential_head_greedy: norm_weight [H], lm_head_weight [V, H] expected");
  const auto dt = lm_head_weight.scalar_type();
  for (const auto* t : {&h, &embed_weight, &w_in, &w_state, &w_out, &norm_weight})
    TORCH_CHECK(t->scalar_type() == dt,
                "dlite::sequential_head_greedy: all float inputs must have lm_head's dtype");
  check_cuda(anchor_ids, h, "anchor_ids");
  check_cuda(embed_weight, h, "embed_weight");
  check_cuda(w_in, h, "w_in");
  check_cuda(w_state, h, "w_state");
  check_cuda(w_out, h, "w_out");
  check_cuda(norm_weight, h, "norm_weight");
  check_cuda(lm_head_weight, h, "lm_head_weight");
  const char* why = dlite::sequential_head_unsupported(int(H), int(r), V, to_dtype(dt));
  TORCH_CHECK(why == nullptr, "dlite::sequential_head_greedy: ", why ? why : "");
  // The two big matrices are never copied behind the caller's back.
  TORCH_CHECK(lm_head_weight.is_contiguous() && embed_weight.is_contiguous(),
              "dlite::sequential_head_greedy: lm_head_weight and embed_weight must be contiguous");

  const c10::cuda::CUDAGuard guard(h.device());
  const at::Tensor hc = h.contiguous(), ids_in = anchor_ids.contiguous(), wi = w_in.contiguous(),
                   ws = w_state.contiguous(), wo = w_out.contiguous(),
                   nw = norm_weight.contiguous();
  at::Tensor draft_ids = at::empty({B, K}, h.options().dtype(at::kLong));
  at::Tensor logits = at::empty({B, K, V}, h.options().dtype(at::kFloat));
  const bool poison = poison_enabled();
  if (poison) {
    draft_ids.fill_(-1);
    logits.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  if (B == 0 || K == 0) return {draft_ids, logits};
  for (const auto& [t, name] :
       {std::pair{&hc, "h"}, {&embed_weight, "embed_weight"}, {&wi, "w_in"}, {&ws, "w_state"},
        {&wo, "w_out"}, {&lm_head_weight, "lm_head_weight"}})
    check_aligned(*t, name);
  at::Tensor workspace = at::empty(
      {int64_t(dlite::sequential_head_workspace_bytes(int(K), int(H), int(r)))},
      h.options().dtype(at::kByte));

  dlite::SequentialHeadArgs a{};
  a.h = hc.data_ptr();
  a.anchor = ids_in.data_ptr<int64_t>();
  a.embed = embed_weight.data_ptr();
  a.embed_rows = embed_weight.size(0);
  a.w_in = wi.data_ptr();
  a.w_state = ws.data_ptr();
  a.w_out = wo.data_ptr();
  a.norm_w = nw.data_ptr();
  a.lm_head = lm_head_weight.data_ptr();
  a.B = int(B);
  a.K = int(K);
  a.H = int(H);
  a.r = int(r);
  a.V = V;
  a.eps = float(eps);
  a.dtype = to_dtype(dt);
  a.draft_ids = draft_ids.data_ptr<int64_t>();
  a.logits = logits.data_ptr<float>();
  a.workspace = workspace.data_ptr();
  a.poison_workspace = poison;
  check_launch(
      dlite::sequential_head_greedy_launch(a, c10::cuda::getCurrentCUDAStream().stream()),
      "sequential_head_greedy");
  return {draft_ids, logits};
}

}  // namespace

TORCH_LIBRARY_IMPL(dlite, CUDA, m) {
  m.impl("draft_attention", &draft_attention_cuda);
  m.impl("sequential_head_greedy", &sequential_head_greedy_cuda);
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
