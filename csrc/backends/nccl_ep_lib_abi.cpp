// Compile-time check of the NCCL EP ABI (nccl_ep.h of NVIDIA's nccl-extensions wheel, API version 2) that
// omniep's `nccl_ep_lib` adapter will be written against (issue 18 item 2). Nothing here runs: it is
// compiled on CPU by the CMake project's compile check (cmake/compile_check.cmake) where nccl_ep.h is found
// (OMNIEP_NCCL_EP_ROOT, or the installed `nccl` package's ep/), and a header whose ABI moved fails the build here, not at run time.
//
// Checked for every public struct that carries `size` / `magic` (the versioned ones; the header also
// defines ncclEpAllocConfig_t, ncclEpDispQuant_t and ncclEpCombQuant_t, which it does not version):
//   * the struct's CURRENT_VERSION, and the bytes of each V<n>_SIZE the header declares, pinned to the
//     values of API version 2 (a new header that changes them must be looked at before the adapter
//     trusts it);
//   * sizeof(struct) == the current version's V<n>_SIZE, and every V<n> boundary (offsetof + size of
//     V<n>_LAST_FIELD == V<n>_SIZE), through the header's own NCCL_EP_STATIC_ASSERT_STRUCT_ABI(_BOUNDARY);
//   * `size` at offset 0 and `magic` at offset 4 (the adapter fills both, as NCCL_EP_*_INIT does in C);
// and NCCL_EP_API_VERSION, NCCL_EP_MAGIC and NCCL_EP_TENSOR_MAGIC.
#include <cstddef>

#include <nccl_ep.h>

static_assert(NCCL_EP_API_VERSION == 2, "nccl_ep_lib is written against NCCL EP API version 2");
static_assert(NCCL_EP_MAGIC == 0xC00FFFEEu, "NCCL_EP_MAGIC changed");
static_assert(NCCL_EP_TENSOR_MAGIC == 0xCAFECAFEu, "NCCL_EP_TENSOR_MAGIC changed");

// `size` first, `magic` right after it, and the current version's size.
#define OMNIEP_EP_STRUCT(type_, base_, current_version_)                                              \
  static_assert(base_##_CURRENT_VERSION == (current_version_), #base_ "_CURRENT_VERSION changed");    \
  static_assert(offsetof(type_, size) == 0 && sizeof(((type_*)nullptr)->size) == 4,                     \
                #type_ ": size is not a 32-bit first field");                                           \
  static_assert(offsetof(type_, magic) == 4 && sizeof(((type_*)nullptr)->magic) == 4,                   \
                #type_ ": magic is not a 32-bit field at offset 4");                                    \
  NCCL_EP_STATIC_ASSERT_STRUCT_ABI(type_, base_)

// Version `v_` of the struct: its declared size pinned to `bytes_`, and its boundary field where it says.
#define OMNIEP_EP_VERSION(type_, base_, v_, bytes_)                                                   \
  static_assert(base_##_V##v_##_SIZE == (bytes_), #base_ "_V" #v_ "_SIZE changed");                    \
  NCCL_EP_STATIC_ASSERT_STRUCT_ABI_BOUNDARY(type_, base_, v_)

OMNIEP_EP_STRUCT(ncclEpTensor_t, NCCL_EP_TENSOR, 1);
OMNIEP_EP_VERSION(ncclEpTensor_t, NCCL_EP_TENSOR, 1, 48u);
static_assert(sizeof(ncclEpTensor_t) == 48u, "ncclEpTensor_t size changed");

OMNIEP_EP_STRUCT(ncclEpTensorAllocConfig_t, NCCL_EP_TENSOR_ALLOC_CONFIG, 1);
OMNIEP_EP_VERSION(ncclEpTensorAllocConfig_t, NCCL_EP_TENSOR_ALLOC_CONFIG, 1, 8u);

OMNIEP_EP_STRUCT(ncclEpGroupConfig_t, NCCL_EP_GROUP_CONFIG, 2);
OMNIEP_EP_VERSION(ncclEpGroupConfig_t, NCCL_EP_GROUP_CONFIG, 1, 96u);
OMNIEP_EP_VERSION(ncclEpGroupConfig_t, NCCL_EP_GROUP_CONFIG, 2, 112u);

OMNIEP_EP_STRUCT(ncclEpLayoutInfo_t, NCCL_EP_LAYOUT_INFO, 2);
OMNIEP_EP_VERSION(ncclEpLayoutInfo_t, NCCL_EP_LAYOUT_INFO, 1, 40u);
OMNIEP_EP_VERSION(ncclEpLayoutInfo_t, NCCL_EP_LAYOUT_INFO, 2, 48u);

OMNIEP_EP_STRUCT(ncclEpDispatchInputs_t, NCCL_EP_DISPATCH_INPUTS, 1);
OMNIEP_EP_VERSION(ncclEpDispatchInputs_t, NCCL_EP_DISPATCH_INPUTS, 1, 32u);

OMNIEP_EP_STRUCT(ncclEpDispatchOutputs_t, NCCL_EP_DISPATCH_OUTPUTS, 1);
OMNIEP_EP_VERSION(ncclEpDispatchOutputs_t, NCCL_EP_DISPATCH_OUTPUTS, 1, 40u);

OMNIEP_EP_STRUCT(ncclEpCombineInputs_t, NCCL_EP_COMBINE_INPUTS, 2);
OMNIEP_EP_VERSION(ncclEpCombineInputs_t, NCCL_EP_COMBINE_INPUTS, 1, 24u);
OMNIEP_EP_VERSION(ncclEpCombineInputs_t, NCCL_EP_COMBINE_INPUTS, 2, 32u);

OMNIEP_EP_STRUCT(ncclEpCombineOutputs_t, NCCL_EP_COMBINE_OUTPUTS, 1);
OMNIEP_EP_VERSION(ncclEpCombineOutputs_t, NCCL_EP_COMBINE_OUTPUTS, 1, 24u);

OMNIEP_EP_STRUCT(ncclEpHandleConfig_t, NCCL_EP_HANDLE_CONFIG, 1);
OMNIEP_EP_VERSION(ncclEpHandleConfig_t, NCCL_EP_HANDLE_CONFIG, 1, 16u);

OMNIEP_EP_STRUCT(ncclEpDispatchConfig_t, NCCL_EP_DISPATCH_CONFIG, 2);
OMNIEP_EP_VERSION(ncclEpDispatchConfig_t, NCCL_EP_DISPATCH_CONFIG, 1, 20u);
OMNIEP_EP_VERSION(ncclEpDispatchConfig_t, NCCL_EP_DISPATCH_CONFIG, 2, 24u);

OMNIEP_EP_STRUCT(ncclEpCombineConfig_t, NCCL_EP_COMBINE_CONFIG, 2);
OMNIEP_EP_VERSION(ncclEpCombineConfig_t, NCCL_EP_COMBINE_CONFIG, 1, 16u);
OMNIEP_EP_VERSION(ncclEpCombineConfig_t, NCCL_EP_COMBINE_CONFIG, 2, 20u);

OMNIEP_EP_STRUCT(ncclEpCompleteConfig_t, NCCL_EP_COMPLETE_CONFIG, 1);
OMNIEP_EP_VERSION(ncclEpCompleteConfig_t, NCCL_EP_COMPLETE_CONFIG, 1, 8u);

// The entry points the adapter will call, with the signatures it will call them with (a changed
// signature fails to convert here).
[[maybe_unused]] static ncclResult_t (*const omniep_ep_create_group)(ncclEpGroup_t*, ncclComm_t,
                                                                      const ncclEpGroupConfig_t*) = ncclEpCreateGroup;
[[maybe_unused]] static ncclResult_t (*const omniep_ep_group_destroy)(ncclEpGroup_t) = ncclEpGroupDestroy;
[[maybe_unused]] static ncclResult_t (*const omniep_ep_handle_destroy)(ncclEpHandle_t) = ncclEpHandleDestroy;
[[maybe_unused]] static ncclResult_t (*const omniep_ep_get_version)(int*) = ncclEpGetVersion;
