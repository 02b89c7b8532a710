"""The portable ``collective`` backend for PyTorch: ``torch.distributed.all_to_all_single``.

One process per device; gloo on CPU, NCCL/RCCL on GPU. Tensors stay on the device of the input.

Data movement per op (DESIGN §5): dispatch = the local layout, ONE count exchange (which on gloo also
carries the rows' routing and fp8 scales) and ONE all-to-all of the rows, received straight into
``recv_x``; combine, cached dispatch and the backward passes = ONE all-to-all each (expert-major
``combine_bwd`` adds one of the weights' gradients). Splits are host integers: a dispatch reads the
counts once; every later op of its handle reuses them (the handle's CPU ``info`` tensor).

Op descriptor (DESIGN §9): the first exchange of every op starts each peer's block with a 64-byte
header, the op descriptor plus the block's body size; every receiver compares (``descriptor.compare``)
before it uses a byte. On gloo the first exchange posts a fixed slot of ``Q`` bytes per peer, the same
on every rank (the group's agreed size, grown only by what every rank saw), and sends at most ``Q``
bytes: gloo accepts a shorter message than posted, so ranks in different ops, or with another H,
dtype or handle, read each other's header and raise instead of aborting on a size mismatch. A block
larger than ``Q`` is sent again, whole, in a second exchange once the headers agree (and ``Q`` grows,
so that is rare). Transports that need equal sizes on both ends (NCCL) post the sizes they expect.

Reductions follow :mod:`omniep.ep_core.reference`: an fp32 accumulator from +0.0, contributions one
at a time (ranks ascending for rank-major, k ascending for expert-major), products rounded to fp32
before the add, bias last, one rounding to the output dtype; bit for bit the reference's.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch

from ..torch_group import PythonOps, TorchGroupBackend
from ...ep_core import validation as v
from ...ep_core.capacity import align_up
from ...ep_core.descriptor import (
    DESC_WORDS, DTYPE_CODES, INPUT_BAD_EXPERT_ID, INPUT_OK, INPUT_REJECTED, STICKY, OpKind, StatusCode,
    compare, descriptor, error_from_status,
)
from ...ep_core.errors import InputError, PeerTimeoutError
from ...ep_core.types import Availability, Capabilities, Layout, ProcessModel
from .torch_layout import (
    acc_dtype, expert_counts, expert_major_plan, expert_major_recv_slots, expert_major_send_slots,
    rank_major_plan, routes,
)

RANK_MAJOR, EXPERT_MAJOR = 0, 1
_LAYOUT_NAMES = ("rank_major", "expert_major")
_CODES = {getattr(torch, name): code for name, code in DTYPE_CODES.items()}

# The header of every block of an op's first exchange: the descriptor, then these words.
HEADER_WORDS = 16
HEADER = 4 * HEADER_WORDS
W_MAGIC, W_BODY, W_BLOCK, W_FLAGS = DESC_WORDS, DESC_WORDS + 1, DESC_WORDS + 2, DESC_WORDS + 3
MAGIC = 0x4F4D4E45
RESEND = 1               # W_FLAGS: a block of this rank is larger than Q: the op needs the second exchange
ALIGN = 16               # every region of a block starts at a multiple of this (dtype views)
MIN_SLOT = 1 << 16       # Q to start with
MAX_HEAD_WORDS = 8192    # header + counts must fit the smallest slot: R + E <= MAX_HEAD_WORDS - 16
# Handle tensors (after recv_topk_idx, recv_topk_weights): topk_idx int32 [T, K], info (CPU int64), tokens
# (int64, the rows this rank sends, destination-major, ascending token inside); expert-major also
# copy_index [T, K] (this rank's copies in the order their owners return them, -1 = none), and for each
# copy it keeps, in (source, token, k) order, its flat slot l * C + c and its rank-major receive row.
IDX32, INFO, TOKENS, COPY_INDEX, COPY_SLOT, COPY_ROW = 2, 3, 4, 5, 6, 7
# info: the dispatch's seq (the handle id), rows of recv_x (rank-major) or slots per expert (C), T, the
# capacity its descriptor named (-1: exact), then per rank: rows sent to it, rows received from it,
# copies sent to it that it keeps, copies kept from it (the last two expert-major only).
I_SEQ, I_ROWS, I_T, I_CAP, I_SPLITS = 0, 1, 2, 3, 4


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _grow(n: int) -> int:
    return (n + n // 4 + 4095) // 4096 * 4096


def _problem(check, *args, **kwargs) -> Optional[str]:
    try:
        check(*args, **kwargs)
    except InputError as exc:
        return str(exc)
    return None


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
        self._fatal = None         # sticky status (a mismatch, a timeout): every later op raises it
        self._fatal_raised = False
        self._pending = None       # first non-sticky status not raised yet (bad input, capacity)
        self._send = self._recv = None
        self._op = OpKind.BARRIER
        self._timeout = datetime.timedelta(seconds=self.timeout_s)

    # ---- statuses (DESIGN §9) -------------------------------------------------------------------

    def check(self) -> None:
        """Raise the sticky status (every time) or else the pending one (once)."""
        if self._fatal is not None:
            self._fatal_raised = True
            raise error_from_status(self._fatal, self.timeout_s)
        if self._pending is not None:
            status, self._pending = self._pending, None
            raise error_from_status(status, self.timeout_s)

    def destroy(self) -> None:
        """Release the context; raise what it still had to report (a status never raised)."""
        self._send = self._recv = None
        super().destroy()
        if self._fatal is not None and not self._fatal_raised:
            self._pending, self._fatal_raised = self._fatal, True
        if self._pending is not None:
            status, self._pending = self._pending, None
            raise error_from_status(status, self.timeout_s)

    def _begin(self, op: OpKind) -> int:
        """The next op's sequence number; a failed context raises at once (on every rank alike)."""
        self._op = op
        if self._fatal is not None:
            self._fatal_raised = True
            raise error_from_status(self._fatal, self.timeout_s)
        self.seq += 1
        return self.seq

    def _settle(self, status: list, wait: bool) -> bool:
        """Act on an op's verdict; True when the op goes on. Raised at once with OMNIEP_CHECKS=sync or at
        a host wait (``wait``); otherwise kept (sticky, or pending until check()/the next wait), and the
        op returns results that moved nothing."""
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
        return code == StatusCode.CAPACITY

    def _report(self, status: list, wait: bool) -> None:
        if wait or self.checks == "sync":
            raise error_from_status(status, self.timeout_s)
        if self._pending is None:
            self._pending = status

    def _status(self, code: StatusCode, peer: int, mine: int, theirs: int, op: OpKind) -> list:
        return [int(code), self.rank, peer, 0, 0, 0, mine, theirs, int(op), self.seq]

    # ---- exchanges --------------------------------------------------------------------------------

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list) -> None:
        work = self._dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:  # the group cannot be trusted after a failed collective
            self._fatal = self._status(StatusCode.PEER_TIMEOUT, -1, 0, 0, self._op)
            self._fatal_raised = True
            if "timed out" in str(exc).lower():
                raise PeerTimeoutError(self.rank, None, self.timeout_s,
                                       what=f"{self._op.name.lower()} #{self.seq} (all_to_all_single)") from exc
            raise

    def _workspace(self, which: str, nbytes: int, device) -> torch.Tensor:
        """A persistent uint8 buffer of at least ``nbytes`` (grown by a quarter): large per-op buffers
        would be fresh pages every call."""
        buf = getattr(self, which)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(_grow(max(nbytes, 1)), dtype=torch.uint8, device=device)
            setattr(self, which, buf)
        return buf

    def _exchange(self, desc: list, bodies: list, write, device, head: Optional[list] = None,
                  expect: Optional[list] = None):
        """The first exchange of an op. Each peer block: the header, ``head`` (int32 words every block
        carries: the dispatch's counts), then a body of ``bodies[d]`` bytes (a multiple of ALIGN; this
        rank's entry is ignored) that ``write(buf, offsets)`` fills, ``offsets[d]`` being where d's body
        starts in ``buf``. ``expect[s]``: body bytes expected from s (transports needing equal sizes).

        Returns ``(status, table, buf, offsets)``: the op's verdict, every rank's header + head words by
        rank, and where each peer's body landed (``offsets[me]`` is None)."""
        R, me, peers = self.world, self.rank, self.peers
        head = head or []
        n_head = len(head)
        head_bytes = _up(4 * n_head)
        sizes = [HEADER + head_bytes + bodies[d] for d in peers]
        big = max(sizes, default=0)
        flags = RESEND if self.tolerant and big > self.slot else 0
        rows = [desc + [MAGIC, head_bytes + bodies[d], big, flags] + head for d in peers]
        mine = desc + [MAGIC, 0, big, flags] + head
        if not peers:
            return compare(desc, [desc], me), [mine], None, [None]
        total = sum(sizes)
        send = self._workspace("_send", total, device)
        offsets, at = [None] * R, 0
        for d, size in zip(peers, sizes):
            offsets[d] = at + HEADER + head_bytes
            at += size
        words = send[:total].view(torch.int32)
        heads = torch.tensor(rows, dtype=torch.int32)
        for i, d in enumerate(peers):
            o = (offsets[d] - HEADER - head_bytes) // 4
            words[o:o + HEADER_WORDS + n_head].copy_(heads[i])
        write(send, offsets)

        # Round 1: the agreed slot per peer (gloo), or exactly what this rank expects.
        if self.tolerant:
            posted = [self.slot] * len(peers)
            sent = [min(n, self.slot) for n in sizes]
        else:
            posted = [HEADER + head_bytes + expect[s] for s in peers]
            sent = sizes
        recv = self._workspace("_recv", sum(posted), device)
        if sent == sizes:
            inp = send[:total]
        else:  # a block larger than the slot: its first Q bytes now (the header), all of it later
            inp = torch.cat([send[o - HEADER - head_bytes:o - HEADER - head_bytes + n]
                             for o, n in zip((offsets[d] for d in peers), sent)])
        self._a2a(recv[:sum(posted)], inp, _with_self(posted, me), _with_self(sent, me))
        starts = _starts(posted)
        rw = recv.view(torch.int32)
        n_words = HEADER_WORDS + n_head
        got = torch.stack([rw[o // 4:o // 4 + n_words] for o in starts]).tolist()
        table = got[:me] + [mine] + got[me:]
        status = compare(desc, [row[:DESC_WORDS] if row[W_MAGIC] == MAGIC else [0] * DESC_WORDS
                                for row in table], me)
        if status[0] == StatusCode.RANK_MISMATCH:
            return status, table, recv, _body_offsets(starts, peers, R, head_bytes)
        if self.tolerant:
            grown = max(row[W_BLOCK] for row in table)
            if grown > self.slot:
                self.slot = _grow(grown)  # every rank saw every row: the same new slot everywhere
        if status[0] != StatusCode.OK or not any(row[W_FLAGS] & RESEND for row in table):
            return status, table, recv, _body_offsets(starts, peers, R, head_bytes)
        # Round 2 (rare): every block again, whole, at the sizes the headers announced.
        posted = [HEADER + table[s][W_BODY] for s in peers]
        recv = torch.empty(sum(posted), dtype=torch.uint8, device=device)
        self._a2a(recv, send[:total], _with_self(posted, me), _with_self(sizes, me))
        return status, table, recv, _body_offsets(_starts(posted), peers, R, head_bytes)

    def _rejected(self, desc: list, problem: str, device, n_head: int = 0) -> None:
        """Take this op's place in the group with a rejected descriptor (its peers stop the op too),
        then raise this rank's own error."""
        self._exchange(desc, [0] * self.world, _nothing, device, head=[0] * n_head, expect=[0] * self.world)
        raise InputError(problem)

    # ---- ops --------------------------------------------------------------------------------------

    def _desc(self, op: OpKind, num_experts: int, hidden: int, dtype, layout: int, capacity: int,
              handle: int = -1, num_topk: int = 0, input_status: int = INPUT_OK, detail: int = 0) -> list:
        return descriptor(seq=self.seq, op=op, num_experts=num_experts, hidden=hidden,
                          dtype=str(dtype).removeprefix("torch."), layout=_LAYOUT_NAMES[layout],
                          capacity=capacity, handle=handle, num_topk=num_topk, input_status=input_status,
                          input_detail=detail)

    def op_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment):
        problem = _problem(self._check_dispatch, x, x_scales, topk_idx, topk_weights, num_experts, capacity,
                           expert_alignment)
        return self.dispatch(x, x_scales, topk_idx, topk_weights, num_experts, layout, capacity, expert_alignment,
                             problem=problem)

    def _check_dispatch(self, x, x_scales, topk_idx, topk_weights, num_experts, capacity, expert_alignment):
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
        T, K = (int(topk_idx.shape[0]), int(topk_idx.shape[1])) if topk_idx.dim() == 2 else (0, 0)
        H = int(x.shape[1]) if x.dim() == 2 else 0
        cap = capacity if capacity >= 0 else (R * T if em else -1)
        self._begin(OpKind.DISPATCH)
        status = INPUT_REJECTED if problem is not None else INPUT_OK
        desc = self._desc(OpKind.DISPATCH, E, H, x.dtype, layout, cap, -1, K, status)
        if problem is not None:
            self._rejected(desc, problem, x.device, R + (E if em else 0))
        wait = not em and cap < 0  # the counted wait: the one host wait of the API
        dev = x.device
        x = x.contiguous()
        owner, in_rank = routes(topk_idx, E, R)
        send_rows = in_rank.sum(0).tolist()
        tokens = in_rank.t().nonzero()[:, 1].clone()  # destination-major, ascending token inside (own storage)
        if T * K:
            lo, hi = torch.aminmax(topk_idx)
            lo, hi = int(lo), int(hi)
            if lo < -1 or hi >= E:  # every rank learns it from the descriptor; nothing moves
                desc[9], desc[10] = INPUT_BAD_EXPERT_ID, lo if lo < -1 else hi
        head = send_rows + (expert_counts(topk_idx, E).tolist() if em else [])
        idx32 = topk_idx.to(torch.int32, copy=True)
        # Each row's routing travels with the counts: [global ids (K int32) | weights (K f32)].
        routing = torch.cat([idx32, topk_weights.to(torch.float32).view(torch.int32)], 1)
        scales = x_scales.to(torch.float32).contiguous() if x_scales is not None else None
        S = scales.shape[1] if scales is not None else 0
        starts = _starts(send_rows)
        side = [_up(n * 8 * K) + _up(n * 4 * S) for n in send_rows]

        def write_side(buf, offsets):
            for d in self.peers:
                n, o = send_rows[d], offsets[d]
                if n:
                    sel = tokens[starts[d]:starts[d] + n]
                    torch.index_select(routing, 0, sel, out=buf[o:o + n * 8 * K].view(torch.int32).view(n, 2 * K))
                    if S:
                        o += _up(n * 8 * K)
                        torch.index_select(scales, 0, sel, out=buf[o:o + n * 4 * S].view(torch.float32).view(n, S))

        if self.tolerant:
            status, table, buf, offsets = self._exchange(desc, side, write_side, dev, head)
        else:
            status, table, buf, offsets = self._exchange(desc, [0] * R, _nothing, dev, head, expect=[0] * R)
        go = self._settle(status, wait)
        tok = [row[HEADER_WORDS:HEADER_WORDS + R] for row in table] if go else [[0] * R] * R
        copies = None
        if em:
            copies = torch.tensor([row[HEADER_WORDS + R:HEADER_WORDS + R + E] for row in table] if go
                                  else [[0] * E] * R, dtype=torch.int64)
        if not go:  # nothing moves: empty results and handle, on every rank alike
            send_rows = [0] * R
            tokens = tokens[:0]
        elif not self.tolerant and R > 1:  # the routing could not ride with the counts: sizes known now
            buf = self._workspace("_recv", sum(_up(tok[s][me] * 8 * K) + _up(tok[s][me] * 4 * S) for s in self.peers),
                                  dev)
            send = self._workspace("_send", sum(side[d] for d in self.peers), dev)
            offsets = [None] * R
            at, at_in = 0, 0
            for d in range(R):
                if d != me:
                    offsets[d], at = at, at + side[d]
            write_side(send, offsets)
            recv_sizes = [_up(tok[s][me] * 8 * K) + _up(tok[s][me] * 4 * S) if s != me else 0 for s in range(R)]
            self._a2a(buf[:sum(recv_sizes)], send[:at], recv_sizes, [side[d] if d != me else 0 for d in range(R)])
            offsets = [None] * R
            for s in self.peers:
                offsets[s], at_in = at_in, at_in + recv_sizes[s]
        # Per source: the routing (and fp8 scales) of every row it sends here, before capacity.
        got = []
        for s in range(R):
            n = tok[s][me]
            if s == me:
                sel = tokens[starts[me]:starts[me] + n]
                got.append((routing[sel], scales[sel] if S else None))
                continue
            o = offsets[s]
            got.append((buf[o:o + n * 8 * K].view(torch.int32).view(n, 2 * K),
                        buf[o + _up(n * 8 * K):o + _up(n * 8 * K) + n * 4 * S].view(torch.float32).view(n, S)
                        if S else None))
        if em:
            return self._dispatch_em(x, scales, idx32, owner, tokens, starts, send_rows, tok, copies, got, cap, E,
                                     K, H, expert_alignment, go)
        return self._dispatch_rm(x, scales, idx32, tokens, starts, tok, got, cap, E, K, H, expert_alignment, go,
                                 wait)

    def _rows_exchange(self, x, send_tokens, send_starts, send_n, recv_n, out: torch.Tensor, out_row0: int):
        """Move rows ``x[send_tokens[...]]`` (``send_n[d]`` to rank d, from ``send_starts[d]``) and receive
        ``recv_n[s]`` rows from each rank into ``out`` from row ``out_row0`` in source order. The splits
        were agreed in this op's first exchange: exact sizes, no header."""
        R, me = self.world, self.rank
        W = x.element_size() * x.shape[1]
        xb, ob = _as_rows(x), _as_rows(out)
        at_me = out_row0 + sum(recv_n[:me])
        # This rank's own rows go straight to their place; the all-to-all moves the peers' only, unless
        # this rank sits between peers in the receive order (then its block travels with theirs).
        inside = 0 < me < R - 1
        own = send_tokens[send_starts[me]:send_starts[me] + send_n[me]]
        if not inside and send_n[me]:
            torch.index_select(xb, 0, own, out=ob[at_me:at_me + send_n[me]])
        if R == 1:
            return
        go_to = [d for d in range(R) if d != me or inside]
        total = sum(send_n[d] for d in go_to)
        send = self._workspace("_send", total * W, x.device)
        at = 0
        for d in go_to:
            n = send_n[d]
            if n:
                torch.index_select(xb, 0, send_tokens[send_starts[d]:send_starts[d] + n],
                                   out=send[at * W:(at + n) * W].view(n, W))
                at += n
        first = out_row0 if (inside or me != 0) else at_me + recv_n[me]
        n_in = sum(recv_n[s] for s in go_to)
        in_splits = [send_n[d] * W if (d != me or inside) else 0 for d in range(R)]
        out_splits = [recv_n[s] * W if (s != me or inside) else 0 for s in range(R)]
        self._a2a(ob[first:first + n_in].view(-1), send[:total * W], out_splits, in_splits)

    def _dispatch_rm(self, x, scales, idx32, tokens, starts, tok, side, cap, E, K, H, align, go, wait):
        R, me, L = self.world, self.rank, E // self.world
        kept_from, kept_to, over = rank_major_plan(tok, me, cap)
        n = sum(kept_from)
        rows = n if cap < 0 else cap
        dev = x.device
        recv_x = (torch.empty if rows == n else torch.zeros)((rows, H), dtype=x.dtype, device=dev)
        if go:
            kept_tokens = tokens if kept_to == [tok[me][d] for d in range(R)] else torch.cat(
                [tokens[starts[d]:starts[d] + kept_to[d]] for d in range(R)])
            kept_starts = [sum(kept_to[:d]) for d in range(R)]
            self._rows_exchange(x, kept_tokens, kept_starts, kept_to, kept_from, recv_x, 0)
            if R > 1:
                self._grow_for(max(_pairs(rank_major_plan, tok, cap, R)), _width(x, scales, H) + 4 * K)
        else:
            kept_tokens = tokens[:0]
        routing = torch.cat([side[s][0][:kept_from[s]] for s in range(R)]) if R > 1 else side[0][0][:n]
        gid, gw = routing[:, :K], routing[:, K:].view(torch.float32)
        mine = (gid >= me * L) & (gid < (me + 1) * L)
        recv_idx, recv_w = torch.where(mine, gid - me * L, -1), torch.where(mine, gw, 0.0)
        if rows > n:  # static capacity: padding rows name no expert
            recv_idx = torch.cat([recv_idx, recv_idx.new_full((rows - n, K), -1)])
            recv_w = torch.cat([recv_w, recv_w.new_zeros((rows - n, K))])
        recv_scales = x.new_empty((0,), dtype=torch.float32)
        if scales is not None:
            recv_scales = torch.zeros((rows, scales.shape[1]), dtype=torch.float32, device=dev)
            if n:
                torch.cat([side[s][1][:kept_from[s]] for s in range(R)], out=recv_scales[:n])
        per_expert = torch.bincount(torch.where(recv_idx >= 0, recv_idx, L).flatten(), minlength=L + 1)[:L]
        info = torch.tensor([self.seq, rows, idx32.shape[0], cap] + kept_to + kept_from + [0] * (2 * R),
                            dtype=torch.int64)
        out = (recv_x, recv_scales, recv_idx, recv_w, _scalar(n, dev), _aligned(per_expert, align),
               _scalar(sum(t[me] for t in tok) - n, dev), [idx32, info, kept_tokens])
        if over is not None:
            self._report(self._status(StatusCode.CAPACITY, over[0], over[1], cap, OpKind.DISPATCH), wait)
        elif wait and self._pending is not None:
            self.check()  # the counted wait raises what earlier ops left pending
        return out

    def _dispatch_em(self, x, scales, idx32, owner, tokens, starts, send_rows, tok, copies, side, C, E, K, H,
                     align, go):
        R, me, L = self.world, self.rank, E // self.world
        dev = x.device
        rows_from = [tok[s][me] for s in range(R)]
        M = sum(rows_from)
        kept, kept_to, kept_from, per_expert, over = expert_major_plan(copies, me, R, C)
        moved = torch.empty((M, H), dtype=x.dtype, device=dev)
        if go:
            self._rows_exchange(x, tokens, starts, send_rows, rows_from, moved, 0)
            if R > 1:
                pair = max(max(_em_pairs(kept, R)), max(tok[s][d] for s in range(R) for d in range(R) if s != d))
                self._grow_for(pair, _width(x, scales, H) + 4)
        routing = torch.cat([side[s][0] for s in range(R)]) if R > 1 else side[0][0]
        gid, gw = routing[:, :K], routing[:, K:].view(torch.float32)
        recv_local = torch.where((gid >= me * L) & (gid < (me + 1) * L), gid - me * L, -1)
        slots = expert_major_recv_slots(recv_local, L, C)
        m, k = torch.nonzero(slots >= 0).unbind(1)
        m = m.clone()  # a handle tensor: its own storage
        local = recv_local[m, k].long()
        flat = local * C + slots[m, k]
        recv_x = torch.zeros((L * C, H), dtype=x.dtype, device=dev)
        _as_rows(recv_x).index_copy_(0, flat, _as_rows(moved)[m])
        recv_idx = torch.full((L * C,), -1, dtype=torch.int32, device=dev)
        recv_idx[flat] = local.to(torch.int32)
        recv_w = torch.zeros((L * C,), dtype=torch.float32, device=dev)
        recv_w[flat] = gw[m, k]
        recv_scales = x.new_empty((0,), dtype=torch.float32)
        if scales is not None:
            S = scales.shape[1]
            sc = torch.cat([side[s][1] for s in range(R)]) if R > 1 else side[0][1]
            recv_scales = torch.zeros((L * C, S), dtype=torch.float32, device=dev)
            recv_scales[flat] = sc[m]
            recv_scales = recv_scales.view(L, C, S)
        if go:
            _, copy_index = expert_major_send_slots(idx32, owner, copies, me, E, R, C)
        else:
            copy_index = torch.full(tuple(idx32.shape), -1, dtype=torch.int64, device=dev)
        num = int(per_expert.sum())
        info = torch.tensor([self.seq, C, idx32.shape[0], C] + send_rows + rows_from + kept_to + kept_from,
                            dtype=torch.int64)
        out = (recv_x.view(L, C, H), recv_scales, recv_idx.view(L, C), recv_w.view(L, C), _scalar(num, dev),
               _aligned(per_expert.to(dev), align), _scalar(int(copies[:, me * L:(me + 1) * L].sum()) - num, dev),
               [idx32, info, tokens, copy_index, flat, m])
        if over is not None:
            self._report(self._status(StatusCode.CAPACITY, over[0], over[1], C, OpKind.DISPATCH), False)
        return out

    def _grow_for(self, rows: int, width: int) -> None:
        """Make the slot hold ``rows`` rows of ``width`` bytes (the largest block the handle's ops will
        send): computed from counts every rank holds, so the slot stays the same everywhere."""
        if self.tolerant:
            need = HEADER + 3 * ALIGN + rows * width
            if need > self.slot:
                self.slot = _grow(need)

    # ---- ops on a handle ------------------------------------------------------------------------

    def _handle_op(self, op: OpKind, handle: list, info: list, num_experts: int, layout: int, hidden: int,
                   dtype, problem: Optional[str], bodies: list, write, expect: list, device):
        """The first exchange of an op on a handle (the handle's id is its dispatch's seq); ``(go, buf,
        offsets)``."""
        self._begin(op)
        K = int(handle[IDX32].shape[1]) if handle[IDX32].dim() == 2 else 0
        desc = self._desc(op, num_experts, hidden, dtype, layout, info[I_CAP], info[I_SEQ], K,
                          INPUT_REJECTED if problem is not None else INPUT_OK)
        if problem is not None:
            self._rejected(desc, problem, device)
        status, _, buf, offsets = self._exchange(desc, bodies, write, device, expect=expect)
        return self._settle(status, False), buf, offsets

    def _splits(self, info: list) -> tuple:
        R = self.world
        s = I_SPLITS
        return info[s:s + R], info[s + R:s + 2 * R], info[s + 2 * R:s + 3 * R], info[s + 3 * R:s + 4 * R]

    def op_cached_dispatch(self, x, x_scales, handle, num_experts, layout, capacity, expert_alignment):
        problem = _problem(v.check_tokens, x, int(handle[IDX32].shape[0]), x_scales=x_scales)
        if problem is None and layout != RANK_MAJOR:
            problem = "cached dispatch serves rank-major handles; dispatch again for the expert-major layout"
        return self.cached_dispatch(x, x_scales, handle, num_experts, layout, capacity, expert_alignment,
                                    problem=problem)

    def cached_dispatch(self, x, x_scales, handle, num_experts, layout, capacity, expert_alignment,
                        problem: Optional[str] = None, op: OpKind = OpKind.CACHED_DISPATCH):
        """``omniep::cached_dispatch``: rows only, with the handle's routing; ``(recv_x, recv_x_scales)``."""
        R, me = self.world, self.rank
        x = x.contiguous()
        H = int(x.shape[1]) if x.dim() == 2 else 0
        info = handle[INFO].tolist()
        send_n, recv_n = self._splits(info)[:2]
        rows = info[I_ROWS]
        scales = x_scales.to(torch.float32) if x_scales is not None else None
        S = scales.shape[1] if scales is not None else 0
        W = x.element_size() * H
        tokens = handle[TOKENS]
        starts = _starts(send_n)
        bodies = [_up(n * W) + _up(n * 4 * S) for n in send_n]

        def write(buf, offsets):
            xb = _as_rows(x)
            for d in self.peers:
                n, o = send_n[d], offsets[d]
                if n:
                    sel = tokens[starts[d]:starts[d] + n]
                    torch.index_select(xb, 0, sel, out=buf[o:o + n * W].view(n, W))
                    if S:
                        o += _up(n * W)
                        torch.index_select(scales, 0, sel, out=buf[o:o + n * 4 * S].view(torch.float32).view(n, S))

        go, buf, offsets = self._handle_op(op, handle, info, num_experts, layout, H, x.dtype, problem,
                                                 bodies, write, [_up(n * W) + _up(n * 4 * S) for n in recv_n],
                                                 x.device)
        n = sum(recv_n)
        recv_x = (torch.empty if rows == n and go else torch.zeros)((rows, H), dtype=x.dtype, device=x.device)
        recv_scales = torch.zeros((rows, S), dtype=torch.float32, device=x.device) if S \
            else x.new_empty((0,), dtype=torch.float32)
        if not go:
            return recv_x, recv_scales
        xb, ob = _as_rows(x), _as_rows(recv_x)
        at = 0
        for s in range(R):
            k = recv_n[s]
            if k and s == me:
                sel = tokens[starts[me]:starts[me] + k]
                torch.index_select(xb, 0, sel, out=ob[at:at + k])
                if S:
                    torch.index_select(scales, 0, sel, out=recv_scales[at:at + k])
            elif k:
                o = offsets[s]
                ob[at:at + k].copy_(buf[o:o + k * W].view(k, W))
                if S:
                    o += _up(k * W)
                    recv_scales[at:at + k].copy_(buf[o:o + k * 4 * S].view(torch.float32).view(k, S))
            at += k
        return recv_x, recv_scales

    def op_combine(self, y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment):
        T = int(handle[IDX32].shape[0])
        shape = "[rows, H]" if layout == RANK_MAJOR else "[num_local_experts, capacity, H]"
        problem = _problem(v.check_combine_input, y, tuple(handle[0].shape[: 1 if layout == RANK_MAJOR else 2]),
                           layout_shape=shape)
        if problem is None:
            biases = tuple(b for b in (bias0, bias1) if b is not None)
            problem = _problem(v.check_bias, biases, T, int(y.shape[-1]))
        return self.combine(y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment,
                            problem=problem)

    def combine(self, y, topk_weights, bias0, bias1, handle, num_experts, layout, capacity, expert_alignment,
                problem: Optional[str] = None):
        """``omniep::combine``: ``out [T, H]`` in ``y``'s dtype."""
        biases = tuple(b for b in (bias0, bias1) if b is not None)
        if layout == EXPERT_MAJOR:
            g_x, _ = self._return_copies(OpKind.COMBINE, y, None, handle, num_experts, topk_weights, problem)
            return _finish(g_x, biases, y.dtype)
        acc, _ = self._return_rows(OpKind.COMBINE, y, None, handle, num_experts, problem)
        return _finish(acc, biases, y.dtype)

    def _return_rows(self, op: OpKind, y, w_rows, handle, num_experts, problem):
        """Rank-major way back: the rows of ``y`` (and ``w_rows [rows, K]`` f32, the dispatch_bwd weight
        gradients) go back to their sources, which sum them over ranks in ascending order. Returns
        ``(acc [T, H] fp32, w back [S, K] destination-major or None)``."""
        R, me = self.world, self.rank
        H = int(y.shape[-1]) if y.dim() == 2 else 0
        info = handle[INFO].tolist()
        send_n, recv_n = self._splits(info)[:2]  # as the dispatch saw them: rows out, rows in
        T = info[I_T]
        K = int(handle[IDX32].shape[1])
        W = y.element_size() * H
        kw = 4 * K if w_rows is not None else 0
        back = _starts(recv_n)
        bodies = [_up(n * W) + _up(n * kw) for n in recv_n]

        def write(buf, offsets):
            yb = _as_rows(y)
            for s in self.peers:
                n, o = recv_n[s], offsets[s]
                if n:
                    buf[o:o + n * W].view(n, W).copy_(yb[back[s]:back[s] + n])
                    if kw:
                        o += _up(n * W)
                        buf[o:o + n * kw].view(torch.float32).view(n, K).copy_(w_rows[back[s]:back[s] + n])

        go, buf, offsets = self._handle_op(op, handle, info, num_experts, RANK_MAJOR, H, y.dtype, problem, bodies,
                                                 write, [_up(n * W) + _up(n * kw) for n in send_n], y.device)
        at = acc_dtype(y.dtype)
        tokens = handle[TOKENS]
        starts = _starts(send_n)
        acc = None
        w_back = [] if kw else None
        for d in range(R):
            n = send_n[d] if go else 0
            if not n:
                continue
            if d == me:
                rows = y[back[me]:back[me] + n]
                if kw:
                    w_back.append(w_rows[back[me]:back[me] + n])
            else:
                o = offsets[d]
                rows = buf[o:o + n * W].view(y.dtype).view(n, H)
                if kw:
                    o += _up(n * W)
                    w_back.append(buf[o:o + n * kw].view(torch.float32).view(n, K))
            if n == T:  # every token: rows are in token order already
                if acc is None:
                    acc = torch.empty((T, H), dtype=at, device=y.device)
                    torch.add(rows, 0.0, out=acc)  # +0.0 + row, as the accumulator starts at +0.0
                else:
                    acc.add_(rows)
            else:
                if acc is None:
                    acc = torch.zeros((T, H), dtype=at, device=y.device)
                acc.index_add_(0, tokens[starts[d]:starts[d] + n], rows.to(at))
        if acc is None:
            acc = torch.zeros((T, H), dtype=at, device=y.device)
        if kw:
            w_back = torch.cat(w_back) if w_back else w_rows.new_zeros((0, K))
        return acc, w_back

    def _return_copies(self, op: OpKind, y, w_copies, handle, num_experts, topk_weights, problem):
        """Expert-major way back: every kept copy of ``y [L, C, H]`` (and ``w_copies [L, C]``) goes back to
        its source, which sums ``topk_weights[t, k] * copy`` over k ascending (weights None: 1). Returns
        ``(acc [T, H], weights' gradients [T, K] or None)``."""
        R, me = self.world, self.rank
        H = int(y.shape[-1]) if y.dim() == 3 else 0
        info = handle[INFO].tolist()
        copy_to, copy_from = self._splits(info)[2:]
        T, K = info[I_T], int(handle[IDX32].shape[1])
        W = y.element_size() * H
        kw = 4 if w_copies is not None else 0
        flat = handle[COPY_SLOT]
        back = _starts(copy_from)
        bodies = [_up(n * W) + _up(n * kw) for n in copy_from]
        y_flat = y.reshape(-1, H) if H else y.reshape(-1, 0)

        def write(buf, offsets):
            for s in self.peers:
                n, o = copy_from[s], offsets[s]
                if n:
                    sel = flat[back[s]:back[s] + n]
                    torch.index_select(_as_rows(y_flat), 0, sel, out=buf[o:o + n * W].view(n, W))
                    if kw:
                        o += _up(n * W)
                        torch.index_select(w_copies.reshape(-1), 0, sel, out=buf[o:o + n * 4].view(torch.float32))

        go, buf, offsets = self._handle_op(op, handle, info, num_experts, EXPERT_MAJOR, H, y.dtype, problem, bodies,
                                                 write, [_up(n * W) + _up(n * kw) for n in copy_to], y.device)
        at = acc_dtype(y.dtype)
        acc = torch.zeros((T, H), dtype=at, device=y.device)
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
                contrib = torch.mul(weights[:, k:k + 1], contrib)
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
        g_w_rows = g_recv_topk_weights.to(torch.float32)
        if layout == EXPERT_MAJOR:
            acc, g_w = self._return_copies(OpKind.DISPATCH_BWD, g_recv_x, g_w_rows, handle, num_experts, None, None)
            return _finish(acc, (), g_recv_x.dtype), g_w
        acc, w_back = self._return_rows(OpKind.DISPATCH_BWD, g_recv_x, g_w_rows.contiguous(), handle, num_experts,
                                        None)
        idx32 = handle[IDX32]
        T, K = idx32.shape
        R = self.world
        info = handle[INFO].tolist()
        send_n = self._splits(info)[0]
        owner, _ = routes(idx32, num_experts, R)
        at = torch.full((T, R + 1), -1, dtype=torch.int64, device=idx32.device)
        if w_back.shape[0]:
            dest = torch.repeat_interleave(torch.arange(R, device=idx32.device),
                                           torch.tensor(send_n, device=idx32.device))
            at[handle[TOKENS], dest] = torch.arange(w_back.shape[0], device=idx32.device)
        row = at.gather(1, owner)
        picked = w_back[row.clamp(min=0), torch.arange(K, device=idx32.device)] if w_back.shape[0] \
            else torch.zeros((T, K), dtype=torch.float32, device=idx32.device)
        return _finish(acc, (), g_recv_x.dtype), torch.where(row >= 0, picked, torch.zeros_like(picked))

    def op_combine_bwd(self, g_out, topk_weights, y, handle, num_experts, layout, capacity, expert_alignment):
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
        H = int(g_out.shape[1])
        info = handle[INFO].tolist()
        send_rows, rows_from, copy_to, copy_from = self._splits(info)
        C, T, K = info[I_ROWS], info[I_T], int(handle[IDX32].shape[1])
        L = num_experts // R
        dtype = y.dtype if y is not None else g_out.dtype
        W = g_out.element_size() * H
        tokens = handle[TOKENS]
        starts = _starts(send_rows)

        def write(buf, offsets):
            gb = _as_rows(g_out)
            for d in self.peers:
                n, o = send_rows[d], offsets[d]
                if n:
                    torch.index_select(gb, 0, tokens[starts[d]:starts[d] + n], out=buf[o:o + n * W].view(n, W))

        go, buf, offsets = self._handle_op(OpKind.COMBINE_BWD, handle, info, num_experts, EXPERT_MAJOR, H, g_out.dtype,
                                                 None, [_up(n * W) for n in send_rows], write,
                                                 [_up(n * W) for n in rows_from], g_out.device)
        g_y = torch.zeros((L * C, H), dtype=dtype, device=g_out.device)
        g_w = torch.zeros((T, K), dtype=torch.float32, device=g_out.device) if y is not None else \
            g_out.new_empty((0,), dtype=torch.float32)
        if not go:
            return g_y.view(L, C, H), g_w
        parts = []
        for s in range(R):
            n = rows_from[s]
            if s == me:
                parts.append(g_out[tokens[starts[me]:starts[me] + n]])
            else:
                parts.append(buf[offsets[s]:offsets[s] + n * W].view(g_out.dtype).view(n, H))
        rows = torch.cat(parts)
        flat, m = handle[COPY_SLOT], handle[COPY_ROW]
        at = acc_dtype(dtype)
        g32 = rows[m].to(at)
        w_copy = handle[1].reshape(-1)[flat].to(at)
        g_y[flat] = torch.mul(w_copy.unsqueeze(-1), g32).to(dtype)
        # The weights' gradients: dot products where the copies are, sent back to their sources.
        dots = torch.zeros((flat.shape[0],), dtype=torch.float32, device=g_out.device)
        if y is not None and flat.shape[0]:
            dots = (g32.to(torch.float64) * y.reshape(-1, H)[flat].to(torch.float64)).sum(-1).to(torch.float32)
        back = _starts(copy_from)
        send = self._workspace("_send", 4 * sum(copy_from[d] for d in self.peers), g_out.device)
        at_b, pieces = 0, []
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
        at_g = 0
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

    def fake_handle(self, topk_idx, num_experts, layout, rows):
        T, K = topk_idx.shape
        ctx = torch.library.get_ctx()
        new = topk_idx.new_empty
        info = torch.empty((I_SPLITS + 4 * self.world,), dtype=torch.int64,
                           device="meta" if topk_idx.device.type == "meta" else "cpu")
        tensors = [new((T, K), dtype=torch.int32), info, new((ctx.new_dynamic_size(),), dtype=torch.int64)]
        if layout == RANK_MAJOR:
            return tensors
        P = ctx.new_dynamic_size()
        return tensors + [new((T, K), dtype=torch.int64), new((P,), dtype=torch.int64), new((P,), dtype=torch.int64)]


# ---- helpers ----------------------------------------------------------------------------------------

def _nothing(buf, offsets) -> None:
    return None


def _with_self(values: list, me: int) -> list:
    """Per-peer values as per-rank splits (0 for this rank: its own block never travels)."""
    return values[:me] + [0] + values[me:]


def _body_offsets(starts: list, peers: list, R: int, head_bytes: int) -> list:
    offsets = [None] * R
    for s, at in zip(peers, starts):
        offsets[s] = at + HEADER + head_bytes
    return offsets


def _starts(counts: list) -> list:
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def _pairs(plan, tok: list, cap: int, R: int) -> list:
    """Rank-major rows kept per (source, destination) pair, sources != destinations."""
    return [plan(tok, r, cap)[0][s] for r in range(R) for s in range(R) if s != r]


def _em_pairs(kept: torch.Tensor, R: int) -> list:
    per = kept.view(R, R, -1).sum(-1).tolist()  # [source][destination]
    return [per[s][d] for s in range(R) for d in range(R) if s != d]


def _width(x, scales, H: int) -> int:
    """Row bytes the ops of a handle may move per row: x's or an fp32 row of the same H, whichever is
    wider, and the fp8 scales."""
    return max(x.element_size() * H, 4 * H) + (4 * scales.shape[1] if scales is not None else 0)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [n, ...]`` (any dtype) as ``[n, bytes per row]`` uint8, a view: rows move as bytes, unchanged.
    (Through a flat view: a tensor torch calls contiguous may still carry odd strides on size-1 dims.)"""
    width = t.element_size()
    for d in t.shape[1:]:
        width *= int(d)
    return t.contiguous().view(-1).view(torch.uint8).view(t.shape[0], width)


def _scalar(value: int, device) -> torch.Tensor:
    return torch.tensor(int(value), dtype=torch.int32, device=device)


def _aligned(per_expert: torch.Tensor, alignment: int) -> torch.Tensor:
    return align_up(per_expert, alignment).to(torch.int32) if alignment > 1 else per_expert.to(torch.int32)


def _finish(acc: torch.Tensor, biases: tuple, dtype: torch.dtype) -> torch.Tensor:
    for b in biases:
        acc.add_(b)
    return acc if acc.dtype == dtype else acc.to(dtype)
