"""The portable ``collective`` backend for PyTorch: ``torch.distributed.all_to_all_single``.

One process per device; gloo on CPU, NCCL/RCCL on GPU. Tensors stay on the device of the input.

Data movement per op (DESIGN §5): dispatch = the local layout and ONE count exchange, which on gloo also
carries the rows' routing and fp8 scales and, once the agreed slot holds them (from the second dispatch
of a shape on, up to BULK bytes per peer), the rows themselves: one collective per dispatch; otherwise
(NCCL, larger rows) ONE more all-to-all of the rows, received straight into ``recv_x``; combine, cached
dispatch and the backward passes = ONE all-to-all each (expert-major ``combine_bwd`` adds one of the
weights' gradients). Splits are host integers: a dispatch reads the
counts once; every later op of its handle reuses them (the handle's CPU ``info`` tensor). A rank's
own rows never travel: they are copied while the all-to-all moves the peers'.

Op descriptor (DESIGN §9): the first exchange of every op starts each peer's block with a 64-byte
header, the op descriptor plus the block's body size; every receiver compares (``descriptor.compare``)
before it uses a byte. On gloo the first exchange posts a fixed slot of ``Q`` bytes per peer, the same
on every rank (the group's agreed size, grown only by what every rank saw), and sends at most ``Q``
bytes: gloo accepts a shorter message than posted (it aborts the process on a longer one), so ranks in
different ops, or with another H, dtype or handle, read each other's header and raise instead. A block
larger than ``Q`` is sent again, whole, in a second exchange once the headers agree (and ``Q`` grows,
so that is rare). Transports that need equal sizes on both ends (NCCL) post the sizes they expect.

Reductions follow :mod:`omniep.ep_core.reference`: an fp32 accumulator from +0.0, contributions one
at a time (ranks ascending for rank-major, k ascending for expert-major), products rounded to fp32
before the add, bias last, one rounding to the output dtype; bit for bit the reference's.
"""

from __future__ import annotations

import datetime
import time
from typing import Optional

import torch

from ..torch_group import PythonOps, TorchGroupBackend
from ...ep_core import validation as v
from ...ep_core.capacity import align_up
from ...ep_core.descriptor import (
    DESC_WORDS, INPUT_BAD_EXPERT_ID, INPUT_OK, INPUT_REJECTED, STATUS_WORDS, STICKY, OpKind, StatusCode,
    compare, descriptor, error_from_status,
)
from ...ep_core.errors import InputError, PeerFailedError, PeerTimeoutError
from ...ep_core.types import Availability, Capabilities, Layout, ProcessModel
from .torch_layout import (
    acc_dtype, expert_counts, expert_major_plan, expert_major_recv_slots, expert_major_send_slots, local_table,
    rank_major_plan, routes,
)

RANK_MAJOR, EXPERT_MAJOR = 0, 1
# A storage's reference count (private in torch; without it _output allocates every time).
_use_count = getattr(torch._C, "_storage_Use_Count", None)
_LAYOUT_NAMES = ("rank_major", "expert_major")
_OK = [0] * STATUS_WORDS  # an OK status (never mutated)

# The header of every block of an op's first exchange: the descriptor, then these words.
HEADER_WORDS = 16
HEADER = 4 * HEADER_WORDS
W_MAGIC, W_BODY, W_BLOCK, W_FLAGS = DESC_WORDS, DESC_WORDS + 1, DESC_WORDS + 2, DESC_WORDS + 3
MAGIC = 0x4F4D4E45
RESEND = 1               # W_FLAGS: a block of this rank is larger than Q: the op needs the second exchange
INLINE = 2               # W_FLAGS (dispatch): this rank's rows ride behind its routing in the first exchange
ALIGN = 16               # every region of a block starts at a multiple of this (dtype views)
MIN_SLOT = 1 << 16       # Q to start with
MAX_HEAD_WORDS = 8192    # header + counts must fit the smallest slot: R + E <= MAX_HEAD_WORDS - 16
# Handle tensors (after recv_topk_idx, recv_topk_weights): topk_idx int32 [T, K]; info (CPU int64);
# sent [T, R] bool, the rows this rank sends to each rank (rank-major: those the receiver keeps);
# expert-major also copy_index [T, K] (this rank's copies in the order their owners return them, -1 =
# none), and for each copy it keeps, in (source, token, k) order, its flat slot l * C + c and its
# rank-major receive row.
IDX32, INFO, SENT, COPY_INDEX, COPY_SLOT, COPY_ROW = 2, 3, 4, 5, 6, 7
# info: the dispatch's seq (the handle id), rows of recv_x (rank-major) or slots per expert (C), T, the
# capacity its descriptor named (-1: exact), the most rows any rank sent another (the same number on
# every rank), then per rank: rows sent to it, rows received from it, copies sent to it that it keeps,
# copies kept from it (the last two expert-major only).
I_SEQ, I_ROWS, I_T, I_CAP, I_PAIR, I_SPLITS = 0, 1, 2, 3, 4, 5
# Rank-major ops on a handle whose rows per peer may exceed this many bytes ("bulk") send the header
# (and small side data) first and the rows then, straight from / into their tensors: one more
# collective's latency (~0.3 ms on the 2-core CPU box) instead of copying the rows behind the header
# and out again (~0.2 ms per MB there). Decided from numbers every rank holds alike.
BULK = 2 << 20


class CollectiveTorch(PythonOps, TorchGroupBackend):
    """The ``collective`` context of ONE rank of a ``torch.distributed`` group (``None``: the default
    group): its op counter, the statuses it has to raise (DESIGN §9) and the exchange workspaces.

    ``op_*`` are the ``omniep::*`` kernels: they validate, then run the op; a rank whose arguments are
    rejected still takes its place in the op's first exchange (so its peers stop too) and raises its
    own :class:`InputError`. :meth:`dispatch`, :meth:`cached_dispatch`, :meth:`combine`,
    :meth:`dispatch_bwd` and :meth:`combine_bwd` are the same ops without the argument checks (float64
    rows too, summed in float64: the adjointness tests).
    """

    name = "collective"

    @classmethod
    def availability(cls) -> Availability:
        try:
            import torch.distributed as dist
        except ImportError as exc:  # pragma: no cover - torch without distributed
            return Availability(False, f"torch.distributed cannot be imported: {exc}")
        if not dist.is_available():
            return Availability(False, f"torch {torch.__version__} was built without torch.distributed")
        return Availability(True, f"torch {torch.__version__}: torch.distributed all_to_all_single "
                                  f"(gloo on CPU, NCCL/RCCL on GPU)")

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            dtypes=("bfloat16", "float16", "float32"), fp8=True,
            layouts=(Layout.RANK_MAJOR, Layout.EXPERT_MAJOR), max_ranks=None, intranode=True,
            internode=True, process_models=(ProcessModel.ONE_PROCESS_PER_DEVICE,),
            frameworks=("torch",), cuda_graph_safe=False, hidden_multiple=1,
        )

    def __init__(self, group=None):
        super().__init__(group)
        import torch.distributed as dist

        self._dist = dist
        # gloo takes a message shorter than the receive it was posted for (never a longer one): the
        # first exchange can post the agreed slot Q. Other transports need equal sizes on both ends.
        self.tolerant = dist.get_backend(self.group) == "gloo"
        self.peers = [r for r in range(self.world) if r != self.rank]
        self.seq = 0
        self.slot = MIN_SLOT
        self._op = OpKind.BARRIER
        self._fatal = None         # sticky status (a mismatch, a timeout): every later op raises it
        self._failure = None       # the error of a failed collective (names the peers): raised again
        self._fatal_raised = False
        self._pending = None       # first non-sticky status not raised yet (bad input, capacity)
        self._send = self._recv = self._rows = None
        self._words = {}
        self._kept = {}            # site -> storages of its last results (CPU; see _output)
        self._timeout = datetime.timedelta(seconds=self.timeout_s)

    # ---- statuses (DESIGN §9) -------------------------------------------------------------------

    def check(self, again: bool = True) -> None:
        """Raise the sticky status (at every check, unless ``again`` is False and it was raised before)
        or else the pending one (once)."""
        if self._fatal is not None and (again or not self._fatal_raised):
            self._fatal_raised = True
            raise self._failure or error_from_status(self._fatal, self.timeout_s)
        if self._pending is not None:
            status, self._pending = self._pending, None
            raise error_from_status(status, self.timeout_s)

    def destroy(self) -> None:
        self._send = self._recv = self._rows = None
        self._kept = {}
        super().destroy()

    def _begin(self, op: OpKind) -> None:
        """Count the op; a failed context raises at once (on every rank alike: they all failed)."""
        self._op = op
        if self._fatal is not None:
            self._fatal_raised = True
            raise self._failure or error_from_status(self._fatal, self.timeout_s)
        self.seq += 1

    def _settle(self, status: list, wait: bool) -> bool:
        """Act on an op's verdict; True when the op goes on. Raised at once with OMNIEP_CHECKS=sync or at
        a host wait (``wait``); otherwise kept (sticky, or pending until check() / the next host wait),
        and the op returns results that moved nothing."""
        code = status[0]
        if code == StatusCode.OK:
            return True
        if code in STICKY:
            self._fatal = status
            if wait or self.checks == "sync":
                self._fatal_raised = True
                raise error_from_status(status, self.timeout_s)
            return False
        self._report(status, wait)
        return False

    def _report(self, status: list, wait: bool) -> None:
        if wait or self.checks == "sync":
            raise error_from_status(status, self.timeout_s)
        if self._pending is None:
            self._pending = status

    def _status(self, code: StatusCode, peer: int, mine: int, theirs: int) -> list:
        return [int(code), self.rank, peer, 0, 0, 0, mine, theirs, int(self._op), self.seq]

    # ---- exchanges --------------------------------------------------------------------------------

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, meanwhile=None) -> None:
        """One ``all_to_all_single`` of byte splits; ``meanwhile()`` runs while it is in flight (this
        rank's own rows, which never travel). A failed or timed-out collective fails the context."""
        work = self._dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        if meanwhile is not None:
            meanwhile()
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:  # the group cannot be trusted after a failed collective
            missing = self._unheard()
            self._fatal = self._status(StatusCode.PEER_TIMEOUT, missing[0] if missing else -1, 0, 0)
            self._fatal_raised = True
            what = f"{self._op.name.lower()} #{self.seq} (all_to_all_single)"
            if "timed out" in str(exc).lower():
                self._failure = PeerTimeoutError(self.rank, None, self.timeout_s, what=what, peers=missing or [])
            else:
                detail = str(exc).splitlines()[0][:200]
                if missing is None:
                    detail += ("; the process group's store is unreachable too: its host (rank 0, when "
                               "torch.distributed was started with a tcp:// address) is likely the one that died")
                self._failure = PeerFailedError(self.rank, missing or [], what, detail=detail)
            raise self._failure from exc

    def _unheard(self) -> Optional[list]:
        """After a collective failed (the failure path only; nothing on the hot path): the group ranks that
        did not report the same failure through the process group's store within a short window — a
        rank that died or is stuck elsewhere. Each rank that gets here writes its key, then reads the
        others'. None when the store cannot be reached (it lives in rank 0's process: rank 0 died)."""
        window = min(2.0, self.timeout_s / 4)
        try:
            store = self._dist.distributed_c10d._get_default_store()
            ranks = self._dist.get_process_group_ranks(self.group)
            prefix = f"omniep/failed/{'-'.join(map(str, ranks))}/{self.id}/{self.seq}/"
            store.set(prefix + str(self.rank), "1")
            deadline = time.monotonic() + window
            while True:
                missing = [r for r in self.peers if not store.check([prefix + str(r)])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 — a store that is gone (its host rank died) tells nothing
            return None

    def _workspace(self, which: str, nbytes: int, device) -> torch.Tensor:
        """A persistent uint8 buffer of at least ``nbytes`` (grown by a quarter): large per-op buffers
        would be fresh pages every call."""
        buf = getattr(self, which)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(_grow(max(nbytes, 1)), dtype=torch.uint8, device=device)
            setattr(self, which, buf)
            # Host memory: the headers are read and written through an int32 numpy view of it (a few
            # words; a torch op per header costs more than the rest of the descriptor handling).
            self._words[which] = buf.numpy().view("<i4") if buf.device.type == "cpu" else None
        return buf

    def _output(self, site: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A new uninitialised ``shape`` tensor for an op's large result (or accumulator) at ``site``. On
        CPU it takes the storage of one of this site's last two results when nothing else holds it any
        more (the usual loops: dispatch, experts, combine, drop; or ``d = dispatch(...)``, where the last
        result lives until the call returns): torch's CPU allocator keeps nothing, and fresh pages fault
        on first touch (~1.4 µs a 4 KB page on the CI machines: ~150 µs at T=128 in the runs where glibc
        has trimmed its heap). Storage is allocated a quarter larger than asked and reused up to twice
        the size asked, so a result's storage may be larger than the result. Other devices have caching
        allocators: a plain ``torch.empty``."""
        if device.type != "cpu" or _use_count is None:
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        kept = self._kept.setdefault(site, [])
        st = next((st for st in kept if nbytes <= st.nbytes() <= 2 * nbytes + 4096 and _use_count(st._cdata) == 1),
                  None)
        if st is None:
            st = torch.empty(_grow(nbytes), dtype=torch.uint8).untyped_storage()
            kept.insert(0, st)
            del kept[2:]
        return torch.empty((0,), dtype=dtype).set_(st, 0, shape)

    def _exchange(self, desc: list, bodies: list, write, device, head: Optional[list] = None,
                  expect: Optional[list] = None, meanwhile=None, flags: int = 0):
        """The first exchange of an op. Each peer block: the header, ``head`` (int32 words every block
        carries: the dispatch's counts), then a body of ``bodies[d]`` bytes (a multiple of ALIGN; this
        rank's entry is ignored) that ``write(buf, offsets)`` fills, ``offsets[d]`` being where d's body
        starts in ``buf``. ``expect[s]``: body bytes expected from s (transports needing equal sizes).
        ``meanwhile()`` runs while the exchange is in flight; ``flags`` go into this rank's W_FLAGS word.

        Returns ``(status, table, buf, offsets)``: the op's verdict, every rank's header + head words by
        rank, and where each peer's body landed (``offsets[me]`` is None)."""
        R, me, peers = self.world, self.rank, self.peers
        head = head or []
        n_words = HEADER_WORDS + len(head)
        lead = _lead(head)
        sizes = [lead + bodies[d] for d in peers]
        big = max(sizes, default=0)
        flags |= RESEND if self.tolerant and big > self.slot else 0
        mine = desc + [MAGIC, 0, big, flags] + head
        if not peers:
            if meanwhile is not None:
                meanwhile()
            return compare(desc, [desc], me), [mine], None, [None]
        total = sum(sizes)
        send = self._workspace("_send", total, device)
        offsets, starts, at = [None] * R, [], 0
        for d, size in zip(peers, sizes):
            starts.append(at)
            offsets[d] = at + lead
            at += size
        rows = [desc + [MAGIC, s - HEADER, big, flags] + head for s in sizes]
        words = self._words["_send"]
        if words is None:  # device memory
            words, rows = send.view(torch.int32), torch.tensor(rows, dtype=torch.int32)
        for row, o in zip(rows, starts):
            words[o // 4:o // 4 + n_words] = row
        write(send, offsets)

        # Round 1: the agreed slot per peer (gloo), or exactly what this rank expects.
        if self.tolerant:
            slot = self.slot
            posted = [slot] * len(peers)
            sent = [min(n, slot) for n in sizes]
        else:
            posted = [lead + expect[s] for s in peers]
            sent = sizes
        recv = self._workspace("_recv", sum(posted), device)
        inp = torch.cat([send[o:o + n] for o, n in zip(starts, sent)]) if flags & RESEND else send[:total]
        self._a2a(recv[:sum(posted)], inp, _with_self(posted, me), _with_self(sent, me), meanwhile)
        at_in = _starts(posted)
        rw = self._words["_recv"]
        if rw is None:
            rw = recv.view(torch.int32)
        if self.tolerant:  # blocks at a fixed stride: one read of every header
            got = rw[:len(peers) * slot // 4].reshape(len(peers), slot // 4)[:, :n_words].tolist()
        else:
            got = [rw[o // 4:o // 4 + n_words].tolist() for o in at_in]
        table = got[:me] + [mine] + got[me:]
        key = desc[:DESC_WORDS - 3]  # the compared fields
        if desc[9] == INPUT_OK and all(row[W_MAGIC] == MAGIC and row[:DESC_WORDS - 3] == key and row[9] == INPUT_OK
                                       for row in got):
            status = _OK  # the common case: every descriptor equal to this rank's, every input good
        else:
            status = compare(desc, [row[:DESC_WORDS] if row[W_MAGIC] == MAGIC else [0] * DESC_WORDS
                                    for row in table], me)
            if status[0] == StatusCode.RANK_MISMATCH:
                return status, table, recv, _body_offsets(at_in, peers, R, lead)
        if self.tolerant:
            grown = max(row[W_BLOCK] for row in table)
            if grown > self.slot:
                self._grow_slot(grown)  # every rank saw every row: the same new slot everywhere
        if status is not _OK or not any(row[W_FLAGS] & RESEND for row in table):
            return status, table, recv, _body_offsets(at_in, peers, R, lead)
        # Round 2 (rare): every block again, whole, at the sizes the headers announced.
        posted = [HEADER + table[s][W_BODY] for s in peers]
        recv = torch.empty(sum(posted), dtype=torch.uint8, device=device)
        self._a2a(recv, send[:total], _with_self(posted, me), _with_self(sizes, me))
        return status, table, recv, _body_offsets(_starts(posted), peers, R, lead)

    def _rejected(self, desc: list, problem: str, device, n_head: int = 0) -> None:
        """Take this op's place in the group with a rejected descriptor (its peers stop the op too),
        then raise this rank's own error."""
        self._exchange(desc, [0] * self.world, _nothing, device, [0] * n_head, expect=[0] * self.world)
        raise InputError(problem)

    def _pack(self, x: torch.Tensor, sel, send_n: list) -> Optional[torch.Tensor]:
        """The rows of ``x`` the peers get (``sel(d)``: their indices, None = all in order; ``send_n[d]`` rows),
        destination after destination, as one byte buffer (``_rows`` workspace); None when x itself is
        that buffer (one destination takes every row in order). This rank's own rows join them only
        when it sits between peers in the receive order."""
        R, me = self.world, self.rank
        go_to = [d for d in range(R) if d != me or 0 < me < R - 1]
        if len(go_to) == 1 and sel(go_to[0]) is None:
            return None
        xb = _as_rows(x)
        W = xb.shape[1]
        buf = self._workspace("_rows", sum(send_n[d] for d in go_to) * W, x.device)
        at = 0
        for d in go_to:
            n = send_n[d]
            _take(xb, sel(d), n, buf[at * W:(at + n) * W].view(n, W))
            at += n
        return buf[:at * W]

    def _rows_exchange(self, x: torch.Tensor, sel, send_n: list, recv_n: list, out: torch.Tensor, then,
                       packed=False) -> None:
        """Rows of ``x`` to every rank d (``sel(d)``: their indices, None = all T in order; ``send_n[d]``
        rows) and ``recv_n[s]`` rows from every rank s into ``out``, in source order. The sizes were
        agreed in this op's first exchange: exact splits, no header. ``packed``: :meth:`_pack` of these
        rows made earlier (False: not made). This rank's own rows go straight to their place while the
        peers' travel (unless it sits between peers in the receive order: then they travel with the
        others), and so does ``then()``, the work that needs no received row."""
        R, me = self.world, self.rank
        xb, ob = _as_rows(x), _as_rows(out)
        W = xb.shape[1]
        at_me = sum(recv_n[:me])
        inside = 0 < me < R - 1

        def meanwhile():
            if not inside:
                _take(xb, sel(me), send_n[me], ob[at_me:at_me + send_n[me]])
            then()

        if R == 1:
            return meanwhile()
        if packed is False:
            packed = self._pack(x, sel, send_n)
        go_to = [d for d in range(R) if d != me or inside]
        first = at_me + recv_n[me] if (me == 0 and not inside) else 0
        n_in = sum(recv_n[s] for s in go_to)
        self._a2a(ob[first:first + n_in].view(-1), xb.view(-1) if packed is None else packed,
                  [recv_n[s] * W if s in go_to else 0 for s in range(R)],
                  [send_n[d] * W if d in go_to else 0 for d in range(R)], meanwhile)

    def _grow_for(self, rows: int, width: int) -> None:
        """Make the slot hold ``rows`` rows of ``width`` bytes (the largest block the handle's ops send):
        computed from counts every rank holds, so the slot stays the same everywhere."""
        if self.tolerant:
            need = HEADER + 3 * ALIGN + rows * width
            if need > self.slot:
                self._grow_slot(need)

    def _grow_dispatch(self, pair: int, x: torch.Tensor, K: int, scales, lead: int) -> None:
        """Make the slot hold a dispatch's block with its rows inline (``pair`` rows: the most any rank sent
        another, the same number everywhere, as are the row sizes, which the descriptors agreed on), so that
        the next dispatch of this shape makes one exchange; rows past BULK never go inline."""
        W = x.element_size() * (x.shape[1] if x.dim() == 2 else 0)
        if self.tolerant and pair * W <= BULK:
            S = scales.shape[1] if scales is not None else 0
            need = lead + _routing_bytes(pair, K, S) + _up(pair * W)
            if need > self.slot:
                self._grow_slot(need)

    def _grow_slot(self, need: int) -> None:
        self.slot = _grow(need)

    def _desc(self, op: OpKind, num_experts: int, hidden: int, dtype, layout: int, capacity: int,
              handle: int = -1, num_topk: int = 0, input_status: int = INPUT_OK) -> list:
        return descriptor(seq=self.seq, op=op, num_experts=num_experts, hidden=hidden,
                          dtype=str(dtype).removeprefix("torch."), layout=_LAYOUT_NAMES[layout],
                          capacity=capacity, handle=handle, num_topk=num_topk, input_status=input_status)

    # ---- dispatch ---------------------------------------------------------------------------------

    def op_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment,
                    zero_padding=False):
        problem = _problem(self._check_dispatch, x, x_scales, topk_idx, topk_weights, num_experts, capacity)
        # zero_padding costs nothing here: the expert-major buffers are made zero before the rows land
        return self.dispatch(x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment,
                             problem=problem)

    def _check_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, capacity):
        v.check_group(num_experts, self.world)
        if self.world + num_experts > MAX_HEAD_WORDS - HEADER_WORDS:
            raise InputError(f"num_experts={num_experts} is too large for the collective backend (at most "
                             f"{MAX_HEAD_WORDS - HEADER_WORDS - self.world} with {self.world} ranks)")
        T, _ = v.check_routing(topk_idx, topk_weights)
        v.check_tokens(x, T, x_scales=x_scales)
        if capacity > 0x7FFFFFFE:
            raise InputError(f"capacity {capacity} is too large")

    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment,
                 problem: Optional[str] = None):
        """``omniep::dispatch`` (outputs as the schema in :mod:`omniep.frontends.torch_ops`)."""
        R, me, E = self.world, self.rank, num_experts
        em = layout == EXPERT_MAJOR
        T, K = (topk_idx.shape[0], topk_idx.shape[1]) if topk_idx.dim() == 2 else (0, 0)
        H = x.shape[1] if x.dim() == 2 else 0
        cap = capacity if capacity >= 0 else (R * T if em else -1)
        self._begin(OpKind.DISPATCH)
        desc = self._desc(OpKind.DISPATCH, E, H, x.dtype, layout, cap, -1, K,
                          INPUT_REJECTED if problem is not None else INPUT_OK)
        n_head = R + (E if em else 0)
        if problem is not None:
            self._rejected(desc, problem, x.device, n_head)
        if T * K:
            lo, hi = torch.aminmax(topk_idx)
            lo, hi = int(lo), int(hi)
            if lo < -1 or hi >= E:  # every rank learns it from this rank's descriptor; nothing moves
                desc[9], desc[10] = INPUT_BAD_EXPERT_ID, lo if lo < -1 else hi
        wait = not em and cap < 0  # the counted wait: the one host wait of the API
        dev = x.device
        x = x.contiguous()
        idx32 = topk_idx.to(torch.int32, copy=True)
        weights = topk_weights.contiguous()
        scales = x_scales.to(torch.float32).contiguous() if x_scales is not None else None
        S = scales.shape[1] if scales is not None else 0
        if desc[9] != INPUT_OK:
            status, *_ = self._exchange(desc, [0] * R, _nothing, dev, [0] * n_head, expect=[0] * R)
            self._settle(status, wait)
            return self._nothing_moved(x, scales, idx32, cap, E, em)
        owner, in_rank = routes(topk_idx, E, R)
        send_n = in_rank.sum(0).tolist()
        sel = _selector(in_rank, send_n, T)
        head = send_n + (expert_counts(topk_idx, E).tolist() if em else [])
        xb = _as_rows(x)
        W = xb.shape[1]
        # Every row's routing rides with the counts: [ids (K int32) | weights (K f32) | fp8 scales], and on
        # gloo the rows themselves behind it (INLINE) when every block fits the slot: one collective for
        # the dispatch instead of two. Larger rows (past BULK, or the first time a shape comes) go in the
        # rows exchange, straight into recv_x; the ranks learn from each other's flags which it is.
        side = [_routing_bytes(n, K, S) for n in send_n]
        lead = _lead(head)
        inline = self.tolerant and R > 1 and all(
            send_n[d] * W <= BULK and lead + side[d] + _up(send_n[d] * W) <= self.slot for d in self.peers)
        if inline:
            side = [b + _up(n * W) for b, n in zip(side, send_n)]

        def write_side(buf, offsets):
            for d in self.peers:
                n, o = send_n[d], offsets[d]
                rows = sel(d)
                _take(idx32, rows, n, buf[o:o + n * 4 * K].view(torch.int32).view(n, K))
                o += _up(n * 4 * K)
                _take(weights, rows, n, buf[o:o + n * 4 * K].view(torch.float32).view(n, K))
                o += _up(n * 4 * K)
                if S:
                    _take(scales, rows, n, buf[o:o + n * 4 * S].view(torch.float32).view(n, S))
                    o += _up(n * 4 * S)
                if inline:
                    _take(xb, rows, n, buf[o:o + n * W].view(n, W))

        packed = []

        def pack():  # while the counts travel: the rows every peer gets, before any capacity cut
            packed.append(self._pack(x, sel, send_n))

        if self.tolerant:
            status, table, buf, offsets = self._exchange(desc, side, write_side, dev, head,
                                                         meanwhile=None if inline else pack,
                                                         flags=INLINE if inline else 0)
        else:
            status, table, buf, offsets = self._exchange(desc, [0] * R, _nothing, dev, head, expect=[0] * R,
                                                         meanwhile=pack)
        if not self._settle(status, wait):
            return self._nothing_moved(x, scales, idx32, cap, E, em)
        tok = [row[HEADER_WORDS:HEADER_WORDS + R] for row in table]
        if not self.tolerant and R > 1:  # the routing could not ride with the counts: sizes known now
            recv_sizes = [_routing_bytes(tok[s][me], K, S) if s != me else 0 for s in range(R)]
            buf = self._workspace("_recv", sum(recv_sizes), dev)
            send = self._workspace("_send", sum(side[d] for d in self.peers), dev)
            offsets, at = [None] * R, 0
            for d in self.peers:
                offsets[d], at = at, at + side[d]
            write_side(send, offsets)
            self._a2a(buf[:sum(recv_sizes)], send[:at], recv_sizes, [side[d] if d != me else 0 for d in range(R)])
            offsets = _with_self(_starts([recv_sizes[s] for s in self.peers]), me)

        def side_of(s: int, n: int):
            """The routing (and scales) of the first ``n`` rows source s sends here: (ids, weights, scales)."""
            if s == me:
                rows = sel(me)
                if rows is not None and n < send_n[me]:
                    rows = rows[:n]
                return (_take(idx32, rows, n), _take(weights, rows, n), _take(scales, rows, n) if S else None)
            o, m = offsets[s], tok[s][me]
            ids = buf[o:o + n * 4 * K].view(torch.int32).view(n, K)
            o += _up(m * 4 * K)
            w = buf[o:o + n * 4 * K].view(torch.float32).view(n, K)
            o += _up(m * 4 * K)
            return ids, w, buf[o:o + n * 4 * S].view(torch.float32).view(n, S) if S else None

        rows_of = None
        if R > 1 and all(row[W_FLAGS] & INLINE for row in table):  # every rank's rows came with the counts
            def rows_of(s: int, n: int) -> torch.Tensor:
                """The first ``n`` rows peer s sent here, as ``[n, W]`` bytes in the receive workspace."""
                m = tok[s][me]
                o = offsets[s] + _routing_bytes(m, K, S)
                return buf[o:o + n * W].view(n, W)

        if em:
            copies = torch.tensor([row[HEADER_WORDS + R:HEADER_WORDS + R + E] for row in table], dtype=torch.int64)
            return self._dispatch_em(x, scales, idx32, owner, in_rank, sel, send_n, tok, copies, side_of, cap, E, K,
                                     expert_alignment, packed[0] if packed else False, rows_of, lead)
        return self._dispatch_rm(x, scales, idx32, in_rank, sel, send_n, tok, side_of, cap, E, K, expert_alignment,
                                 wait, packed[0] if packed else False, rows_of, lead)

    def _dispatch_rm(self, x, scales, idx32, in_rank, sel_all, send_n, tok, side_of, cap, E, K, align, wait, packed,
                     rows_of, lead):
        R, me, L = self.world, self.rank, E // self.world
        T, H = x.shape
        kept_from, kept_to, over = rank_major_plan(tok, me, cap)
        n = sum(kept_from)
        rows = n if cap < 0 else cap
        dev = x.device
        if kept_to == send_n:
            sent = in_rank
        else:  # a destination keeps the first rows in token order: those within its share
            sent = in_rank & (in_rank.cumsum(0) <= torch.tensor(kept_to, device=dev))
            packed = False  # packed before the cut
        recv_x = self._output("dispatch", (rows, H), x.dtype, dev)
        pair = max((tok[s][d] for s in range(R) for d in range(R) if s != d), default=0)
        out = []

        def routing():  # from the count exchange: while the rows travel
            parts = [side_of(s, kept_from[s]) for s in range(R)]
            ids, w = (torch.cat([p[i] for p in parts]) if R > 1 else parts[0][i] for i in (0, 1))
            recv_idx = local_table(E, R, me, dev)[ids]  # local expert id, -1: another rank's
            recv_w = torch.where(recv_idx >= 0, w, 0.0)
            per_expert = torch.bincount(recv_idx.view(-1) + 1, minlength=L + 1)[1:]
            recv_scales = x.new_empty((0,), dtype=torch.float32)
            if scales is not None:
                recv_scales = torch.zeros((rows, scales.shape[1]), dtype=torch.float32, device=dev)
                torch.cat([p[2] for p in parts], out=recv_scales[:n])
            if rows > n:  # static capacity: padding rows are zero and name no expert
                recv_x[n:].zero_()
                recv_idx = torch.cat([recv_idx, recv_idx.new_full((rows - n, K), -1)])
                recv_w = torch.cat([recv_w, recv_w.new_zeros((rows - n, K))])
            info = torch.tensor([self.seq, rows, T, cap, pair] + kept_to + kept_from + [0] * (2 * R), dtype=torch.int64)
            out.extend((recv_scales, recv_idx, recv_w, _scalar(n, dev), _aligned(per_expert, align),
                        _scalar(sum(t[me] for t in tok) - n, dev), [idx32, info, sent]))

        sel = sel_all if sent is in_rank else _selector(sent, kept_to, T)
        if rows_of is not None:  # the rows came with the counts: each source's first kept rows, in place
            _place(recv_x, x, sel(me), kept_from, me, rows_of)
            routing()
        else:
            self._rows_exchange(x, sel, kept_to, kept_from, recv_x, routing, packed)
        if R > 1:  # the handle's ops move at most these rows per pair
            self._grow_for(pair, _width(x, scales, H) + 4 * K)
            self._grow_dispatch(pair, x, K, scales, lead)
        if over is not None:
            self._report(self._status(StatusCode.CAPACITY, over[0], over[1], cap), wait)
        elif wait and self._pending is not None:
            self.check()  # the counted wait raises what earlier ops left pending
        return (recv_x, *out)

    def _dispatch_em(self, x, scales, idx32, owner, in_rank, sel, send_n, tok, copies, side_of, C, E, K, align,
                     packed, rows_of, lead):
        R, me, L = self.world, self.rank, E // self.world
        T, H = x.shape
        dev = x.device
        rows_from = [tok[s][me] for s in range(R)]
        M = sum(rows_from)
        kept, kept_to, kept_from, per_expert, over = expert_major_plan(copies, me, R, C)
        moved = self._output("dispatch_em_rows", (M, H), x.dtype, dev)
        if rows_of is not None:
            _place(moved, x, sel(me), rows_from, me, rows_of)
        else:
            self._rows_exchange(x, sel, send_n, rows_from, moved, _nothing, packed)
        pair = max((tok[s][d] for s in range(R) for d in range(R) if s != d), default=0)
        if R > 1:  # the handle's ops move at most these rows (copies) per pair
            self._grow_for(max(max(_em_pairs(kept, R)), pair), _width(x, scales, H) + 4)
            self._grow_dispatch(pair, x, K, scales, lead)
        parts = [side_of(s, rows_from[s]) for s in range(R)]
        ids, w = (torch.cat([p[i] for p in parts]) if R > 1 else parts[0][i] for i in (0, 1))
        recv_local = local_table(E, R, me, dev)[ids]
        slots = expert_major_recv_slots(recv_local, L, C)
        m, k = torch.nonzero(slots >= 0).unbind(1)
        m = m.clone()  # a handle tensor: its own storage
        local = recv_local[m, k].long()
        flat = local * C + slots[m, k]
        recv_x = self._output("dispatch_em", (L * C, H), x.dtype, dev).zero_()
        _as_rows(recv_x).index_copy_(0, flat, _as_rows(moved)[m])
        recv_idx = torch.full((L * C,), -1, dtype=torch.int32, device=dev)
        recv_idx[flat] = local.to(torch.int32)
        recv_w = torch.zeros((L * C,), dtype=torch.float32, device=dev)
        recv_w[flat] = w[m, k]
        recv_scales = x.new_empty((0,), dtype=torch.float32)
        if scales is not None:
            S = scales.shape[1]
            sc = torch.cat([p[2] for p in parts])
            recv_scales = torch.zeros((L * C, S), dtype=torch.float32, device=dev)
            recv_scales[flat] = sc[m]
            recv_scales = recv_scales.view(L, C, S)
        copy_index = expert_major_send_slots(idx32, owner, copies, me, E, R, C)
        num = int(per_expert.sum())
        info = torch.tensor([self.seq, C, T, C, pair] + send_n + rows_from + kept_to + kept_from, dtype=torch.int64)
        out = (recv_x.view(L, C, H), recv_scales, recv_idx.view(L, C), recv_w.view(L, C), _scalar(num, dev),
               _aligned(per_expert.to(dev), align), _scalar(int(copies[:, me * L:(me + 1) * L].sum()) - num, dev),
               [idx32, info, in_rank, copy_index, flat, m])
        if over is not None:
            self._report(self._status(StatusCode.CAPACITY, over[0], over[1], C), False)
        return out

    def _nothing_moved(self, x, scales, idx32, cap, E, em):
        """A dispatch's results when its verdict stopped it (default checks mode): no rows, and a handle
        whose ops move nothing either, the same on every rank."""
        R, L, dev = self.world, E // self.world, x.device
        T, K = idx32.shape
        H = x.shape[1] if x.dim() == 2 else 0
        S = scales.shape[1] if scales is not None else 0
        lead = (L, cap) if em else (max(cap, 0),)
        info = torch.tensor([self.seq, lead[-1], T, cap, 0] + [0] * (4 * R), dtype=torch.int64)
        handle = [idx32, info, torch.zeros((T, R), dtype=torch.bool, device=dev)]
        if em:
            none = torch.empty((0,), dtype=torch.int64, device=dev)
            handle += [torch.full((T, K), -1, dtype=torch.int64, device=dev), none, none.clone()]
        per_copy = lead if em else lead + (K,)
        f32 = torch.float32
        return (torch.zeros(lead + (H,), dtype=x.dtype, device=dev),
                torch.zeros(lead + (S,), dtype=f32, device=dev) if S else x.new_empty((0,), dtype=f32),
                torch.full(per_copy, -1, dtype=torch.int32, device=dev), torch.zeros(per_copy, dtype=f32, device=dev),
                _scalar(0, dev), torch.zeros((L,), dtype=torch.int32, device=dev), _scalar(0, dev), handle)

    # ---- ops on a handle ------------------------------------------------------------------------

    def _handle_op(self, op: OpKind, handle: list, info: list, num_experts: int, layout: int, hidden: int,
                   dtype, problem: Optional[str], bodies: list, write, expect: list, device, meanwhile=None):
        """The first exchange of an op on a handle (the handle's id is its dispatch's seq); ``(go, buf,
        offsets)``."""
        self._begin(op)
        K = handle[IDX32].shape[1] if handle[IDX32].dim() == 2 else 0
        desc = self._desc(op, num_experts, hidden, dtype, layout, info[I_CAP], info[I_SEQ], K,
                          INPUT_REJECTED if problem is not None else INPUT_OK)
        if problem is not None:
            self._rejected(desc, problem, device)
        status, _, buf, offsets = self._exchange(desc, bodies, write, device, expect=expect, meanwhile=meanwhile)
        return self._settle(status, False), buf, offsets

    def _splits(self, info: list) -> tuple:
        R, s = self.world, I_SPLITS
        return info[s:s + R], info[s + R:s + 2 * R], info[s + 2 * R:s + 3 * R], info[s + 3 * R:s + 4 * R]

    def op_cached_dispatch(self, x, x_scales, handle, num_experts, layout, capacity, expert_alignment):
        problem = _problem(v.check_tokens, x, handle[IDX32].shape[0], x_scales=x_scales)
        if problem is None and layout != RANK_MAJOR:
            problem = "cached dispatch serves rank-major handles; dispatch again for the expert-major layout"
        return self.cached_dispatch(x, x_scales, handle, num_experts, layout, capacity, expert_alignment,
                                    problem=problem)

    def cached_dispatch(self, x, x_scales, handle, num_experts, layout, capacity, expert_alignment,
                        problem: Optional[str] = None, op: OpKind = OpKind.CACHED_DISPATCH):
        """``omniep::cached_dispatch``: rows only, with the handle's routing; ``(recv_x, recv_x_scales)``."""
        me = self.rank
        x = x.contiguous()
        T, H = x.shape if x.dim() == 2 else (0, 0)
        info = handle[INFO].tolist()
        send_n, recv_n = self._splits(info)[:2]
        rows = info[I_ROWS]
        scales = x_scales.to(torch.float32).contiguous() if x_scales is not None else None
        S = scales.shape[1] if scales is not None else 0
        xb = _as_rows(x)
        W = xb.shape[1]
        bulk = info[I_PAIR] * W > BULK  # the rows go after the header, straight into recv_x
        Wx = 0 if bulk else W
        sel = _selector(handle[SENT], send_n, T)

        def write(buf, offsets):
            for d in self.peers:
                n, o = send_n[d], offsets[d]
                if not bulk:
                    _take(xb, sel(d), n, buf[o:o + n * W].view(n, W))
                if S:
                    o += _up(n * Wx)
                    _take(scales, sel(d), n, buf[o:o + n * 4 * S].view(torch.float32).view(n, S))

        n = sum(recv_n)
        recv_x = self._output("cached_dispatch", (rows, H), x.dtype, x.device)
        recv_scales = torch.zeros((rows, S), dtype=torch.float32, device=x.device) if S \
            else x.new_empty((0,), dtype=torch.float32)
        ob, back = _as_rows(recv_x), _starts(recv_n)

        def own_scales():
            if S:
                _take(scales, sel(me), send_n[me], recv_scales[back[me]:back[me] + send_n[me]])

        def own():
            _take(xb, sel(me), send_n[me], ob[back[me]:back[me] + send_n[me]])
            own_scales()

        go, buf, offsets = self._handle_op(op, handle, info, num_experts, layout, H, x.dtype, problem,
                                           [_up(k * Wx) + _up(k * 4 * S) for k in send_n], write,
                                           [_up(k * Wx) + _up(k * 4 * S) for k in recv_n], x.device,
                                           own if problem is None and not bulk else None)
        if not go:
            return recv_x.zero_(), recv_scales
        if rows > n:
            ob[n:].zero_()
        for s in self.peers:
            k, o = recv_n[s], offsets[s]
            if not bulk:
                ob[back[s]:back[s] + k].copy_(buf[o:o + k * W].view(k, W))
            if S:
                o += _up(k * Wx)
                recv_scales[back[s]:back[s] + k].copy_(buf[o:o + k * 4 * S].view(torch.float32).view(k, S))
        if bulk:
            self._rows_exchange(x, sel, send_n, recv_n, recv_x, own_scales)
        return recv_x, recv_scales

    def op_combine(self, y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment,
                   zero_padding=False):
        T = handle[IDX32].shape[0]
        shape = "[rows, H]" if layout == RANK_MAJOR else "[num_local_experts, capacity, H]"
        problem = _problem(v.check_combine_input, y, tuple(handle[0].shape[: 1 if layout == RANK_MAJOR else 2]),
                           layout_shape=shape)
        if problem is None and (bias0 is not None or bias1 is not None):
            problem = _problem(v.check_bias, tuple(b for b in (bias0, bias1) if b is not None), T, y.shape[-1])
        return self.combine(y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment,
                            problem=problem)

    def combine(self, y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment,
                problem: Optional[str] = None):
        """``omniep::combine``: ``out [T, H]`` in ``y``'s dtype."""
        if layout == EXPERT_MAJOR:
            acc, _ = self._return_copies(OpKind.COMBINE, y, None, handle, num_experts, topk_weights, problem)
            return _rounded(acc, (bias0, bias1), y.dtype, True)
        acc, _, from_zero = self._return_rows(OpKind.COMBINE, y, None, handle, num_experts, problem)
        return _rounded(acc, (bias0, bias1), y.dtype, from_zero)

    def _return_rows(self, op: OpKind, y, w_rows, handle, num_experts, problem):
        """Rank-major way back: the rows of ``y`` (and ``w_rows [rows, K]`` f32, the dispatch_bwd weight
        gradients) go back to their sources, which sum them over ranks in ascending order. Returns
        ``(acc [T, H], w back [S, K] destination-major or None, from_zero)``: ``acc`` is the sum in the
        accumulator dtype, begun with the reference's leading ``+0.0`` where ``from_zero`` (the first
        contribution written as ``+0.0 + c``: the pass a copy would take), else without it (see
        :func:`_rounded`, which then adds it last).
        Bulk rows go as they are, after the header (and the weight gradients)."""
        R, me = self.world, self.rank
        y = y.contiguous()
        H = y.shape[-1] if y.dim() == 2 else 0
        info = handle[INFO].tolist()
        send_n, recv_n = info[I_SPLITS:I_SPLITS + R], info[I_SPLITS + R:I_SPLITS + 2 * R]  # as dispatched
        T = info[I_T]
        K = handle[IDX32].shape[1]
        W = y.element_size() * H
        bulk = info[I_PAIR] * W > BULK
        Wy = 0 if bulk else W
        kw = 4 * K if w_rows is not None else 0
        back = _starts(recv_n)
        at = acc_dtype(y.dtype)
        acc = self._output(op.name, (T, H), at, y.device)
        yb = _as_rows(y)
        whole = [d for d in range(R) if send_n[d]]
        whole = whole if all(send_n[d] == T for d in whole) else []
        # This rank's rows start the accumulator while the peers' travel when they come first, or
        # second of two (then the first is added in front of them: the operands in the reference's
        # order, which decides a NaN's payload; the signs of zero are settled at the end).
        own_early = me in whole[:2] and len(whole) <= 2 and problem is None
        own_second = own_early and whole[0] != me

        def write(buf, offsets):
            for s in self.peers:
                n, o = recv_n[s], offsets[s]
                if n and not bulk:
                    buf[o:o + n * W].view(n, W).copy_(yb[back[s]:back[s] + n])
                if n and kw:
                    o += _up(n * Wy)
                    buf[o:o + n * kw].view(torch.float32).view(n, K).copy_(w_rows[back[s]:back[s] + n])

        def own():
            torch.add(y[back[me]:back[me] + T], 0.0, out=acc)

        sizes = [[_up(n * Wy) + _up(n * kw) for n in counts] for counts in (recv_n, send_n)]
        go, buf, offsets = self._handle_op(op, handle, info, num_experts, RANK_MAJOR, H, y.dtype, problem, sizes[0],
                                           write, sizes[1], y.device, own if own_early and not bulk else None)
        if not go:
            return acc.zero_(), (w_rows.new_zeros((0, K)) if kw else None), True
        w_back = [] if kw else None
        if kw:
            for d in range(R):
                n = send_n[d]
                if d == me:
                    w_back.append(w_rows[back[me]:back[me] + n])
                elif n:
                    o = offsets[d] + _up(n * Wy)
                    w_back.append(buf[o:o + n * kw].view(torch.float32).view(n, K))
            w_back = torch.cat(w_back) if w_back else w_rows.new_zeros((0, K))
        if bulk:  # the rows now: straight from y into a workspace, this rank's own start meanwhile
            buf, offsets = self._blocks_exchange(yb, back, recv_n, send_n, own if own_early else _nothing)
        sel = _selector(handle[SENT], send_n, T)
        ready, pending, from_zero = own_early, None, True
        for d in range(R):
            n = send_n[d]
            if not n or (d == me and own_early):
                continue
            rows = y[back[me]:back[me] + n] if d == me else buf[offsets[d]:offsets[d] + n * W].view(y.dtype).view(n, H)
            if n == T:  # every token, in token order
                if own_second:  # c1 + (+0.0 + c2) is (+0.0 + c1) + c2, bit for bit (NaN payloads included)
                    torch.add(rows, acc, out=acc)
                    own_second = False
                elif ready:
                    acc.add_(rows)
                elif pending is not None:  # two whole contributions: one pass unless rows need converting
                    if rows.dtype == at:
                        torch.add(pending, rows, out=acc)
                        from_zero = False
                    else:
                        torch.add(pending, 0.0, out=acc)
                        acc.add_(rows)
                    ready, pending = True, None
                else:
                    pending = rows
            else:
                if pending is not None:
                    torch.add(pending, 0.0, out=acc)
                    ready, pending = True, None
                if not ready:
                    acc.zero_()
                    ready = True
                acc.index_add_(0, sel(d), rows.to(at))
        if pending is not None:
            torch.add(pending, 0.0, out=acc)
        elif not ready:
            acc.zero_()
        return acc, w_back, from_zero

    def _blocks_exchange(self, src: torch.Tensor, starts: list, send_n: list, recv_n: list, meanwhile):
        """Rows ``src[starts[d]:starts[d] + send_n[d]]`` (byte rows, blocks in rank order) to every peer d,
        ``recv_n[s]`` rows from every peer s into the receive workspace, exact sizes agreed in the op's
        first exchange; ``(buf, offsets)`` of what arrived (``offsets[s]`` in bytes, None for this rank,
        whose block travels only when it sits between peers)."""
        R, me = self.world, self.rank
        W = src.shape[1]
        inside = 0 < me < R - 1
        go = [d for d in range(R) if d != me or inside]
        first, last = go[0], go[-1]
        inp = src[starts[first]:starts[last] + send_n[last]].reshape(-1)
        sizes = [recv_n[s] * W if s in go else 0 for s in range(R)]
        buf = self._workspace("_recv", sum(sizes), src.device)
        self._a2a(buf[:sum(sizes)], inp, sizes, [send_n[d] * W if d in go else 0 for d in range(R)], meanwhile)
        offsets = _starts(sizes)
        return buf, [None if s == me else offsets[s] for s in range(R)]

    def _return_copies(self, op: OpKind, y, w_copies, handle, num_experts, topk_weights, problem):
        """Expert-major way back: every kept copy of ``y [L, C, H]`` (and ``w_copies [L, C]``) goes back to
        its source, which sums ``topk_weights[t, k] * copy`` over k ascending (weights None: 1). Returns
        ``(acc [T, H], weights' gradients [T, K] or None)``."""
        R, me = self.world, self.rank
        H = y.shape[-1] if y.dim() == 3 else 0
        info = handle[INFO].tolist()
        copy_to, copy_from = self._splits(info)[2:]
        T, K = info[I_T], handle[IDX32].shape[1]
        W = y.element_size() * H
        kw = 4 if w_copies is not None else 0
        flat = handle[COPY_SLOT]
        back = _starts(copy_from)
        y_flat = y.contiguous().view(-1, H) if H else y.reshape(-1, 0)
        yb = _as_rows(y_flat)

        def write(buf, offsets):
            for s in self.peers:
                n, o = copy_from[s], offsets[s]
                if n:
                    sel = flat[back[s]:back[s] + n]
                    torch.index_select(yb, 0, sel, out=buf[o:o + n * W].view(n, W))
                    if kw:
                        o += _up(n * W)
                        torch.index_select(w_copies.reshape(-1), 0, sel, out=buf[o:o + n * 4].view(torch.float32))

        go, buf, offsets = self._handle_op(op, handle, info, num_experts, EXPERT_MAJOR, H, y.dtype, problem,
                                           [_up(n * W) + _up(n * kw) for n in copy_from], write,
                                           [_up(n * W) + _up(n * kw) for n in copy_to], y.device)
        at = acc_dtype(y.dtype)
        acc = self._output(op.name + "_em", (T, H), at, y.device).zero_()
        g_w = torch.zeros((T, K), dtype=torch.float32, device=y.device) if kw else None
        if not go or sum(copy_to) == 0:
            return acc, g_w
        parts, w_parts = [], []
        for d in range(R):
            n = copy_to[d]
            if d == me:
                sel = flat[back[me]:back[me] + n]
                parts.append(y_flat[sel])
                if kw:
                    w_parts.append(w_copies.reshape(-1)[sel])
            else:
                o = offsets[d]
                parts.append(buf[o:o + n * W].view(y.dtype).view(n, H))
                if kw:
                    o += _up(n * W)
                    w_parts.append(buf[o:o + n * 4].view(torch.float32))
        rows = torch.cat(parts)
        copy_index = handle[COPY_INDEX]
        weights = topk_weights.to(at) if topk_weights is not None else None
        for k in range(K):
            at_k = copy_index[:, k]
            contrib = rows[at_k.clamp(min=0)].to(at)
            if weights is not None:
                contrib = torch.mul(weights[:, k:k + 1], contrib)  # rounded before the add: no fused multiply-add
            acc = torch.where((at_k >= 0).unsqueeze(-1), torch.add(acc, contrib), acc)
        if kw:
            w_all = torch.cat(w_parts)
            g_w = torch.where(copy_index >= 0, w_all[copy_index.clamp(min=0)], torch.zeros_like(g_w))
        return acc, g_w

    def op_dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle, num_experts, layout, capacity, expert_alignment):
        return self.dispatch_bwd(g_recv_x, g_recv_topk_weights, handle, num_experts, layout, capacity,
                                 expert_alignment)

    def dispatch_bwd(self, g_recv_x, g_recv_topk_weights, handle, num_experts, layout, capacity, expert_alignment):
        """``omniep::dispatch_bwd``: ``(g_x [T, H] in g_recv_x's dtype, g_topk_weights [T, K] f32)``."""
        g_w_rows = g_recv_topk_weights.to(torch.float32).contiguous()
        if layout == EXPERT_MAJOR:
            acc, g_w = self._return_copies(OpKind.DISPATCH_BWD, g_recv_x, g_w_rows, handle, num_experts, None, None)
            return _rounded(acc, (), g_recv_x.dtype, True), g_w
        acc, w_back, from_zero = self._return_rows(OpKind.DISPATCH_BWD, g_recv_x, g_w_rows, handle, num_experts, None)
        idx32, sent = handle[IDX32], handle[SENT]
        T, K = idx32.shape
        R, dev = self.world, idx32.device
        owner, _ = routes(idx32, num_experts, R)
        # Where the row of (t, owner) sits among the rows that came back (destination-major).
        at = torch.full((T, R + 1), -1, dtype=torch.int64, device=dev)
        d_idx, t_idx = sent.t().nonzero().unbind(1)
        at[t_idx, d_idx] = torch.arange(t_idx.shape[0], device=dev)
        row = at.gather(1, owner)
        picked = w_back[row.clamp(min=0), torch.arange(K, device=dev)] if w_back.shape[0] \
            else torch.zeros((T, K), dtype=torch.float32, device=dev)
        return _rounded(acc, (), g_recv_x.dtype, from_zero), torch.where(row >= 0, picked, torch.zeros_like(picked))

    def op_combine_bwd(self, g_out, topk_weights, y, handle, num_experts, layout, capacity, expert_alignment,
                       zero_padding=False):
        # zero_padding costs nothing here: g_y is made zero before the rows land (padding zero either way)
        return self.combine_bwd(g_out, topk_weights, y, handle, num_experts, layout, capacity, expert_alignment)

    def combine_bwd(self, g_out, topk_weights, y, handle, num_experts, layout, capacity, expert_alignment):
        """``omniep::combine_bwd``: ``(g_y, g_topk_weights)``. Rank-major: ``g_y`` is a cached dispatch of
        ``g_out`` (``g_topk_weights`` empty). Expert-major: ``g_y[l, c] = round(w[t, k] * g_out[t])`` and,
        given ``y``, ``g_topk_weights[t, k] = <g_out[t], y[l, c]>`` summed in float64, rounded to float32."""
        if layout == RANK_MAJOR:
            g_y, _ = self.cached_dispatch(g_out, None, handle, num_experts, layout, capacity, expert_alignment,
                                          op=OpKind.COMBINE_BWD)
            return g_y, g_out.new_empty((0,), dtype=torch.float32)
        R, me = self.world, self.rank
        g_out = g_out.contiguous()
        T, H = g_out.shape
        info = handle[INFO].tolist()
        send_n, rows_from, copy_to, copy_from = self._splits(info)
        C, K = info[I_ROWS], handle[IDX32].shape[1]
        L = num_experts // R
        dtype = y.dtype if y is not None else g_out.dtype
        gb = _as_rows(g_out)
        W = gb.shape[1]
        sel = _selector(handle[SENT], send_n, T)

        def write(buf, offsets):
            for d in self.peers:
                n, o = send_n[d], offsets[d]
                _take(gb, sel(d), n, buf[o:o + n * W].view(n, W))

        go, buf, offsets = self._handle_op(OpKind.COMBINE_BWD, handle, info, num_experts, EXPERT_MAJOR, H, g_out.dtype,
                                           None, [_up(n * W) for n in send_n], write,
                                           [_up(n * W) for n in rows_from], g_out.device)
        g_y = torch.zeros((L * C, H), dtype=dtype, device=g_out.device)
        g_w = torch.zeros((T, K), dtype=torch.float32, device=g_out.device) if y is not None else \
            g_out.new_empty((0,), dtype=torch.float32)
        if not go:
            return g_y.view(L, C, H), g_w
        parts = [_take(g_out, sel(me), send_n[me]) if s == me
                 else buf[offsets[s]:offsets[s] + rows_from[s] * W].view(g_out.dtype).view(rows_from[s], H)
                 for s in range(R)]
        rows = torch.cat(parts)
        flat, m = handle[COPY_SLOT], handle[COPY_ROW]
        at = acc_dtype(dtype)
        g32 = rows[m].to(at)
        w_copy = handle[1].reshape(-1)[flat].to(at)
        g_y[flat] = torch.mul(w_copy.unsqueeze(-1), g32).to(dtype)
        # The weights' gradients: dot products where the copies are, then back to their sources (every
        # expert-major combine_bwd makes this second, exact-size exchange: the ranks agree on it).
        dots = torch.zeros((flat.shape[0],), dtype=torch.float32, device=g_out.device)
        if y is not None and flat.shape[0]:
            dots = (g32.to(torch.float64) * y.reshape(-1, H)[flat].to(torch.float64)).sum(-1).to(torch.float32)
        back = _starts(copy_from)
        send = self._workspace("_send", 4 * sum(copy_from[d] for d in self.peers), g_out.device)
        at_b = 0
        for d in self.peers:
            n = copy_from[d]
            send[at_b:at_b + 4 * n].view(torch.float32).copy_(dots[back[d]:back[d] + n])
            at_b += 4 * n
        got = torch.empty(4 * sum(copy_to[s] for s in self.peers), dtype=torch.uint8, device=g_out.device)
        if self.peers:
            self._a2a(got, send[:at_b], [4 * copy_to[s] if s != me else 0 for s in range(R)],
                      [4 * copy_from[d] if d != me else 0 for d in range(R)])
        if y is None:
            return g_y.view(L, C, H), g_w
        pieces, at_g = [], 0
        for d in range(R):
            n = copy_to[d]
            if d == me:
                pieces.append(dots[back[me]:back[me] + n])
            else:
                pieces.append(got[at_g:at_g + 4 * n].view(torch.float32))
                at_g += 4 * n
        all_dots = torch.cat(pieces)
        copy_index = handle[COPY_INDEX]
        if all_dots.shape[0]:
            g_w = torch.where(copy_index >= 0, all_dots[copy_index.clamp(min=0)], torch.zeros_like(g_w))
        return g_y.view(L, C, H), g_w

    # ---- what the shared fake kernels need (torch.compile, opcheck) -------------------------------

    def source_counts(self, tensors, num_experts):
        R = self.world
        return tensors[INFO][I_SPLITS + R:I_SPLITS + 2 * R].to(device=tensors[IDX32].device, dtype=torch.int32)

    def fake_handle(self, topk_idx, num_experts, layout, rows):
        T, K = topk_idx.shape
        new = topk_idx.new_empty
        info = torch.empty((I_SPLITS + 4 * self.world,), dtype=torch.int64,
                           device="meta" if topk_idx.device.type == "meta" else "cpu")
        tensors = [new((T, K), dtype=torch.int32), info, new((T, self.world), dtype=torch.bool)]
        if layout == RANK_MAJOR:
            return tensors
        P = torch.library.get_ctx().new_dynamic_size()
        return tensors + [new((T, K), dtype=torch.int64), new((P,), dtype=torch.int64), new((P,), dtype=torch.int64)]


# ---- helpers ----------------------------------------------------------------------------------------

def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _lead(head: list) -> int:
    """Bytes of a first-exchange block before its body: the header and the ``head`` words."""
    return HEADER + _up(4 * len(head))


def _routing_bytes(n: int, K: int, S: int) -> int:
    """Bytes of the routing of ``n`` dispatched rows in a block: ids (K int32), weights (K f32) and fp8
    scales (S f32), each region padded to ALIGN; inline rows follow it."""
    return _up(n * 4 * K) * 2 + _up(n * 4 * S)


def _grow(n: int) -> int:
    return (n + n // 4 + 4095) // 4096 * 4096


def _problem(check, *args, **kwargs) -> Optional[str]:
    try:
        check(*args, **kwargs)
    except InputError as exc:
        return str(exc)
    return None


def _nothing(*_) -> None:
    return None


def _with_self(values: list, me: int) -> list:
    """Per-peer values as per-rank splits (0 for this rank: its own block never travels)."""
    return values[:me] + [0] + values[me:]


def _body_offsets(starts: list, peers: list, R: int, lead: int) -> list:
    offsets = [None] * R
    for s, at in zip(peers, starts):
        offsets[s] = at + lead
    return offsets


def _starts(counts: list) -> list:
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def _selector(mask: torch.Tensor, counts: list, T: int):
    """``sel(d)``: the tokens ``mask[:, d]`` selects, ascending (None when it is every token: the rows go
    as they are, no gather); looked up once per destination."""
    found = {}

    def sel(d: int):
        if counts[d] == T:
            return None
        rows = found.get(d)
        if rows is None:
            rows = found[d] = mask[:, d].nonzero().view(-1)
        return rows
    return sel


def _place(out: torch.Tensor, x: torch.Tensor, own, counts: list, me: int, rows_of) -> None:
    """``out [sum(counts), ...]``: ``counts[s]`` rows from every rank s in rank order — this rank's own from
    ``x`` (``own``: their indices, None = the first ones in order), a peer's from ``rows_of(s, n)``."""
    ob, xb = _as_rows(out), _as_rows(x)
    at = 0
    for s, n in enumerate(counts):
        if n:
            if s == me:
                _take(xb, own, n, ob[at:at + n])
            else:
                ob[at:at + n].copy_(rows_of(s, n))
        at += n


def _take(src: torch.Tensor, rows, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``src[rows]`` (``rows`` None: the first ``n`` rows as they are) into ``out`` (or a new tensor)."""
    if rows is None:
        return src[:n] if out is None else out.copy_(src[:n])
    return torch.index_select(src, 0, rows) if out is None else torch.index_select(src, 0, rows, out=out)


def _em_pairs(kept: torch.Tensor, R: int) -> list:
    per = kept.view(R, R, -1).sum(-1).tolist()  # [source][destination]
    return [per[s][d] for s in range(R) for d in range(R) if s != d]


def _width(x, scales, H: int) -> int:
    """Row bytes the ops of a handle may move per row: x's or an fp32 row of the same H, whichever is
    wider, and the fp8 scales."""
    return max(x.element_size() * H, 4 * H) + (4 * scales.shape[1] if scales is not None else 0)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [n, ...]`` (any dtype) as ``[n, bytes per row]`` uint8, a view: rows move as bytes, unchanged.
    (Through a flat view unless plainly 2-D: a tensor torch calls contiguous may still carry odd strides
    on size-1 dims.)"""
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]:
        return t.view(torch.uint8)
    width = t.element_size()
    for d in t.shape[1:]:
        width *= int(d)
    return t.contiguous().view(-1).view(torch.uint8).view(t.shape[0], width)


def _rounded(acc: torch.Tensor, biases: tuple, dtype: torch.dtype, from_zero: bool) -> torch.Tensor:
    """The reference's ``round(((+0.0 + c1) + c2 + ...) + b1 + b2)`` from ``acc``: ``(+0.0 + c1) + c2 +
    ...`` where ``from_zero``, else ``c1 + c2 + ...``. The two differ only where every term is -0.0
    (-0.0 there, +0.0 here), so one ``+0.0`` after the biases makes the latter equal bit for bit (NaN
    payloads included); then one rounding to ``dtype``."""
    for b in biases:
        if b is not None:
            acc.add_(b)
    if not from_zero:
        acc.add_(0.0)
    return acc if acc.dtype == dtype else acc.to(dtype)


def _scalar(value: int, device) -> torch.Tensor:
    return torch.tensor(int(value), dtype=torch.int32, device=device)


def _aligned(per_expert: torch.Tensor, alignment: int) -> torch.Tensor:
    return align_up(per_expert, alignment).to(torch.int32) if alignment > 1 else per_expert.to(torch.int32)
