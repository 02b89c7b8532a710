"""Golden vectors: small cases with the reference's results, stored as ``tests/golden/*.npz``.

Every backend on every vendor must reproduce them bit for bit. Arrays are stored as raw bits
(bfloat16 as uint16) with their dtype name beside them, so the files need nothing but numpy to read.

Per rank ``r`` a file holds inputs ``x``, ``topk_idx``, ``topk_weights``, ``y`` (combine input shaped
like ``recv_x``), ``bias`` (one ``[T, H]``), ``g_out`` (combine backward input), ``g_recv_x`` and
``g_recv_w`` (dispatch backward inputs), and the expected ``recv_x``, ``recv_topk_idx``,
``recv_topk_weights``, ``num_recv``, ``num_recv_tokens_per_expert``, ``dropped``, ``out`` (combine of
``y`` with ``bias``), ``g_x``, ``g_w`` (dispatch backward) and ``g_y`` (combine backward).
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from omniep.ep_core import reference as ref
from omniep.ep_core.types import Layout
from omniep.testing.cases import Case, make_case, np_dtype
from omniep.testing.compare import assert_bitwise_equal, raw_bits

# The library's comparison comes along: the suites call it as golden.assert_bitwise_equal.
__all__ = ["GOLDEN_DIR", "GOLDEN_CASES", "INPUTS", "EXPECTED", "Golden", "static_capacity", "compute",
           "reference_results", "save", "load", "golden_files", "write_all", "assert_bitwise_equal", "counted_rows"]

GOLDEN_DIR = pathlib.Path(__file__).resolve().parents[1] / "golden"

INPUTS = ("x", "topk_idx", "topk_weights", "y", "bias", "g_out", "g_recv_x", "g_recv_w")
EXPECTED = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv", "num_recv_tokens_per_expert",
            "dropped", "out", "g_x", "g_w", "g_y")

# (name, make_case keyword arguments). Equal token counts on every rank, so static-shape frameworks
# can run every file.
GOLDEN_CASES = [
    ("rm_r2_bf16", dict(num_ranks=2, num_experts=4, num_topk=2, hidden=8, num_tokens=5, dtype="bfloat16")),
    ("rm_r4_fp32_int64", dict(num_ranks=4, num_experts=8, num_topk=3, hidden=8, num_tokens=6,
                              index_dtype="int64")),
    ("rm_r4_fp16_align4", dict(num_ranks=4, num_experts=8, num_topk=2, hidden=16, num_tokens=4,
                               dtype="float16", expert_alignment=4)),
    ("rm_r2_overflow", dict(num_ranks=2, num_experts=2, num_topk=2, hidden=8, num_tokens=6, capacity=7,
                            skew="one_rank", dtype="bfloat16")),
    ("rm_r4_empty_rank", dict(num_ranks=4, num_experts=4, num_topk=2, hidden=8, num_tokens=3,
                              skew="empty_rank")),
    ("em_r2_bf16", dict(num_ranks=2, num_experts=4, num_topk=2, hidden=8, num_tokens=5, dtype="bfloat16",
                        layout=Layout.EXPERT_MAJOR)),
    ("em_r4_fp32", dict(num_ranks=4, num_experts=8, num_topk=3, hidden=8, num_tokens=4,
                        layout=Layout.EXPERT_MAJOR, expert_alignment=2)),
    ("em_r2_overflow", dict(num_ranks=2, num_experts=4, num_topk=2, hidden=8, num_tokens=6, capacity=3,
                            skew="one_expert", layout=Layout.EXPERT_MAJOR)),
]


@dataclasses.dataclass
class Golden:
    name: str
    case: Case
    inputs: dict    # name -> per-rank list of arrays
    expected: dict  # name -> per-rank list of arrays (scalars as 0-d arrays)


def static_capacity(case: Case) -> int:
    """Capacity every rank uses: the case's, or the static default ``R*T`` (golden cases have equal T)."""
    return case.capacity if case.capacity is not None else case.num_ranks * case.x[0].shape[0]


def compute(case: Case, seed: int = 0) -> tuple[dict, dict]:
    """Inputs and reference results of one case at its static capacity."""
    rng = np.random.default_rng(seed + 1)
    plan = ref.make_plan(case.topk_idx, case.config(static_capacity(case)))
    disp = ref.dispatch(case.x, case.topk_weights, plan)
    dt = np_dtype(case.dtype)
    R = case.num_ranks

    def randn(shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dt)

    inputs = {
        "x": case.x, "topk_idx": case.topk_idx, "topk_weights": case.topk_weights,
        "y": [randn(d.recv_x.shape) for d in disp],
        "bias": [randn(x.shape) for x in case.x],
        "g_out": [randn(x.shape) for x in case.x],
        "g_recv_x": [randn(d.recv_x.shape) for d in disp],
        "g_recv_w": [rng.standard_normal(d.recv_topk_weights.shape).astype(np.float32) for d in disp],
    }
    expected = {k: v for k, v in reference_results(case, inputs).items() if k in EXPECTED}
    assert all(len(v) == R for v in (*inputs.values(), *expected.values()))
    return inputs, expected


def reference_results(case: Case, inputs: dict, capacity: int | None = None) -> dict:
    """What the reference computes from inputs shaped like a golden file's (see the module docstring).

    ``capacity`` defaults to :func:`static_capacity`. Biases come from ``inputs["biases"]`` (per rank a
    tuple of up to two ``[T, H]`` arrays) or else ``inputs["bias"]`` (one per rank). Beyond the golden
    fields, the result holds ``g_w_combine`` (the expert-major combine's weight gradient, zeros for
    rank-major) and ``g_bias`` (per rank, ``g_out`` cast to each bias dtype).
    """
    plan = ref.make_plan(inputs["topk_idx"], case.config(static_capacity(case) if capacity is None else capacity))
    disp = ref.dispatch(inputs["x"], inputs["topk_weights"], plan)
    biases = inputs["biases"] if "biases" in inputs else [(b,) for b in inputs["bias"]]
    out = ref.combine(inputs["y"], plan, topk_weights=inputs["topk_weights"], bias=biases)
    g_x, g_w = ref.dispatch_bwd(inputs["g_recv_x"], inputs["g_recv_w"], plan)
    g_y, g_wc = ref.combine_bwd(inputs["g_out"], plan, ys=inputs["y"], topk_weights=inputs["topk_weights"])
    if g_wc is None:  # rank-major combine does not read the weights
        g_wc = [np.zeros(w.shape, np.float32) for w in inputs["topk_weights"]]
    return {
        "recv_x": [d.recv_x for d in disp], "recv_topk_idx": [d.recv_topk_idx for d in disp],
        "recv_topk_weights": [d.recv_topk_weights for d in disp],
        "num_recv": [np.array(d.num_recv, np.int32) for d in disp],
        "num_recv_tokens_per_expert": [d.num_recv_tokens_per_expert for d in disp],
        "dropped": [np.array(d.dropped, np.int32) for d in disp],
        "out": out, "g_x": g_x, "g_w": g_w, "g_y": g_y, "g_w_combine": g_wc,
        "g_bias": [tuple(g.astype(b.dtype) for b in bs) for g, bs in zip(inputs["g_out"], biases)],
    }


def counted_rows(recv_x, recv_topk_idx) -> np.ndarray:
    """``recv_x`` with its expert-major padding slots (``recv_topk_idx[l, c] == -1``) zeroed, for
    comparisons: DESIGN §2 leaves those rows unspecified (``zero_padding=False``), the reference zeroes
    them. A rank-major ``recv_x`` (2-D) comes back unchanged."""
    x = np.array(recv_x, copy=True)
    idx = np.asarray(recv_topk_idx)
    if x.ndim == 3 and idx.shape == x.shape[:2]:
        x[idx < 0] = 0
    return x


def save(path: pathlib.Path, case: Case, inputs: dict, expected: dict) -> None:
    arrays = {
        "meta_num_ranks": np.int64(case.num_ranks), "meta_num_experts": np.int64(case.num_experts),
        "meta_capacity": np.int64(-1 if case.capacity is None else case.capacity),
        "meta_expert_alignment": np.int64(case.expert_alignment),
        "meta_layout": np.str_(case.layout.value), "meta_dtype": np.str_(case.dtype),
        "meta_index_dtype": np.str_(case.index_dtype),
    }
    for group in (inputs, expected):
        for key, per_rank in group.items():
            for r, a in enumerate(per_rank):
                a = np.asarray(a)
                arrays[f"{key}__{r}"] = raw_bits(a)
                arrays[f"{key}__{r}__dtype"] = np.str_(a.dtype.name)
    np.savez_compressed(path, **arrays)


def load(path) -> Golden:
    path = pathlib.Path(path)
    with np.load(path) as f:
        data = {k: f[k] for k in f.files}
    R = int(data["meta_num_ranks"])

    def get(key):
        return [data[f"{key}__{r}"].view(np_dtype(str(data[f"{key}__{r}__dtype"]))) for r in range(R)]

    cap = int(data["meta_capacity"])
    inputs = {k: get(k) for k in INPUTS}
    case = Case(R, int(data["meta_num_experts"]), int(inputs["x"][0].shape[1]), str(data["meta_dtype"]),
                str(data["meta_index_dtype"]), inputs["x"], inputs["topk_idx"], inputs["topk_weights"],
                Layout(str(data["meta_layout"])), None if cap < 0 else cap, int(data["meta_expert_alignment"]))
    return Golden(path.stem, case, inputs, {k: get(k) for k in EXPECTED})


def golden_files() -> list[pathlib.Path]:
    return sorted(GOLDEN_DIR.glob("*.npz"))


def write_all(directory: pathlib.Path = GOLDEN_DIR) -> list[pathlib.Path]:
    """(Re)make every golden file from the reference. Run ``python tests/harness/golden.py``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed, (name, kwargs) in enumerate(GOLDEN_CASES):
        case = make_case(seed, **kwargs)
        inputs, expected = compute(case, seed)
        save(directory / f"{name}.npz", case, inputs, expected)
        paths.append(directory / f"{name}.npz")
    return paths


if __name__ == "__main__":
    for p in write_all():
        print(p)
